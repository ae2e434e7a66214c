#!/usr/bin/env python3
"""Joiners of elastic runs on this machine (issue 17, ADR 0005 section 11): the time from a joiner's
start (`troupe launch --join`) and from its arrival in the job to the first step completed after it
took its place. The demo GPT (gpt2-demo, B=8 T=128, --threads 1), dp2 x pp2 (--microbatches 2) on 4
ranks with no spare, STEPS steps, rank 3 SIGKILLs itself before its forward pass of step KILL:

  join-replace  --join-wait 120: the driver waits for a joiner, which takes rank 3's place (its
                state from a data-parallel replica); the plan does not change
  join-grow     --min-ranks 2 and the drill --await-join KILL+5: the run shrinks to dp1 x pp2, and
                before step KILL+5 waits for a joiner, then grows back to dp2 x pp2 (the idle
                survivor and the joiner take the second replica, their state from the first)

The joiner is started when the driver says it waits for one. Times are stamped by this script as
the lines arrive: joiner start -> the driver's admission line ("a joiner took rank 3's place") ->
the first step completed after it; the driver's own figure from the joiner's arrival in the
membership (its "completed on dp2 x pp2 X s after the joiner ... arrived" line, join-grow) and the
recovery's "recovery took" (join-replace). Load average before and after: on the shared 2-vCPU
machine every figure needs it.

  python3 scripts/bench/elastic_join.py [build-dir] [steps] [kill-step] [rounds]
"""
import os
import re
import subprocess
import sys
import tempfile

from timed_lines import first, run_timed

build = sys.argv[1] if len(sys.argv) > 1 else "build"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
kill = int(sys.argv[3]) if len(sys.argv) > 3 else 10
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
troupe = os.path.join(build, "apps", "troupe")
token = "bench-join-%d" % os.getpid()
common = ["train", "--model", "gpt2-demo", "--batch", "8", "--seq", "128", "--steps", str(steps),
          "--sample", "0", "--log-every", "1000", "--threads", "1", "--elastic", "--dp", "2",
          "--pp", "2", "--microbatches", "2", "--chaos-kill", "3:%d:forward" % kill]
rows = [
    ("join-replace", [], ["--join-wait", "120"], "for a joiner (troupe launch --join)",
     "elastic: step %d completed" % kill),
    ("join-grow", ["--min-ranks", "2"], ["--await-join", str(kill + 5)],
     "for a joiner before step", "completed on dp2 x pp2"),
]


def run(name, launch, extra, trigger, done):
    argv = [troupe, "launch", "-n", "4", "--token", token, "--grace", "300"] + launch + [
        "--job", "bench-%s-%d" % (name, os.getpid()), "--", troupe] + common + extra
    st = {"coord": None, "joiner": None, "t_join": None}
    log = tempfile.TemporaryFile("w+")

    def on_line(t, line):
        port = re.search(r"coordinator on [^ ]+:([0-9]+)", line)
        if port:
            st["coord"] = "127.0.0.1:" + port.group(1)
        if st["joiner"] is None and trigger in line:
            st["t_join"] = t
            st["joiner"] = subprocess.Popen(
                [troupe, "launch", "--join", "--coordinator", st["coord"], "--token", token, "--",
                 troupe] + common + extra, stdout=log, stderr=subprocess.STDOUT)

    rc, lines = run_timed(argv, on_line)
    jrc = st["joiner"].wait() if st["joiner"] else -1
    return rc, jrc, st["t_join"], lines


def report(name, done, rc, jrc, t_join, lines):
    out = "%-12s rc %d joiner rc %d" % (name, rc, jrc)
    ta, _ = first(lines, "a joiner took rank")
    ts, line = first(lines, done, t_join or 0.0)
    if t_join is not None and ta is not None and ts is not None:
        own = re.search(r"([0-9.]+) s after the joiner", line)
        _, rec = first(lines, "rank 3 took its place")
        took = re.search(r"recovery took ([0-9.]+) s", rec or "")
        _, grew = first(lines, "elastic: grew")
        gtook = re.search(r"growing took ([0-9.]+) s", grew or "")
        out += ("; joiner start -> admitted %.3f s, -> first step after it %.3f s; driver: %s" % (
            ta - t_join, ts - t_join,
            ("arrival -> step on the grown plan %s s, growing took %s s" % (
                own.group(1), gtook.group(1) if gtook else "?")) if own else
            ("recovery took %s s" % (took.group(1) if took else "?"))))
    print(out, flush=True)
    if rc != 0 or jrc != 0:
        print("\n".join(l for _, l in lines[-20:]))


print("%d steps, kill at step %d; load average before: %s" % (
    steps, kill, " ".join(open("/proc/loadavg").read().split()[:3])), flush=True)
for k in range(rounds):
    for name, launch, extra, trigger, done in rows if k % 2 == 0 else rows[::-1]:
        report(name, done, *run(name, launch, extra, trigger, done))
print("load average after: %s" % " ".join(open("/proc/loadavg").read().split()[:3]), flush=True)
