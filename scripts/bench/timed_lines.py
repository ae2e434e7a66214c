"""What the elastic benchmarks share (elastic.py, elastic_zero.py, elastic_shrink.py,
elastic_join.py): running a
command with every output line stamped by the seconds since its start, and finding a line."""
import subprocess
import time


def run_timed(argv, on_line=None):
    """Runs argv; returns its exit code and its output lines as (seconds since start, line).
    on_line(seconds, line), when given, sees each line as it arrives."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if on_line:
            on_line(*lines[-1])
    return p.wait(), lines


def first(lines, needle, after=0.0):
    """The first (seconds, line) at or after `after` whose line holds needle; (None, None) when
    none does."""
    for t, line in lines:
        if needle in line and t >= after:
            return t, line
    return None, None
