"""What the elastic benchmarks share (elastic.py, elastic_zero.py, elastic_shrink.py): running a
command with every output line stamped by the seconds since its start, and finding a line."""
import subprocess
import time


def run_timed(argv):
    """Runs argv; returns its exit code and its output lines as (seconds since start, line)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in p.stdout]
    return p.wait(), lines


def first(lines, needle):
    """The first (seconds, line) whose line holds needle; (None, None) when none does."""
    for t, line in lines:
        if needle in line:
            return t, line
    return None, None
