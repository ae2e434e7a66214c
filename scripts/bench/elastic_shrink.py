#!/usr/bin/env python3
"""Shrinking elastic runs on this machine (issue 17 item 3): the time from a rank's SIGKILL to the
first step completed after the job re-planned onto its survivors, beside replacing the rank with a
spare. The demo GPT (gpt2-demo, B=8 T=128, --threads 1) trained STEPS steps, the kill at step KILL:

  replace     dp2 x pp2 (--microbatches 2) on 4 ranks + 1 spare, rank 3 SIGKILLs itself before its
              forward pass of step KILL: the spare takes its place (state from a dp replica)
  shrink      the same on 4 ranks, no spare, --min-ranks 2: dp1 x pp2 on 2 ranks, micro-batches
              2 -> 4 (nothing copied: each stage's state is on a survivor)
  shrink-commit  as shrink, rank 1 killed at its commit of step KILL
  zero1       dp4 --zero 1 --replica-interval 1 on 4 ranks, no spare, --min-ranks 2, rank 2 killed
              before its forward pass: dp2, the shards resharded (the lost one from its buddy)
  zero3       the same with --zero 3

The rows run ROUNDS times, interleaved (every other round reversed), so a change of the machine's
load hits them alike. Each output line is timestamped on arrival: the time from the killed rank's
last line (elastic.chaos_kill, printed just before its SIGKILL) to the recovery's log line and to
"elastic: step N completed", the recovery's own "recovery took" figure, and the driver's tokens/s
over the whole run. Load average before and after: on the shared 2-vCPU machine every figure
needs it.

  python3 scripts/bench/elastic_shrink.py [build-dir] [steps] [kill-step] [rounds]
"""
import os
import re
import sys

from timed_lines import first, run_timed

build = sys.argv[1] if len(sys.argv) > 1 else "build"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
kill = int(sys.argv[3]) if len(sys.argv) > 3 else 30
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
troupe = os.path.join(build, "apps", "troupe")
common = ["train", "--model", "gpt2-demo", "--batch", "8", "--seq", "128", "--steps", str(steps),
          "--sample", "0", "--log-every", "1000", "--threads", "1", "--elastic"]
pp = ["--dp", "2", "--pp", "2", "--microbatches", "2"]
rows = [
    ("replace", ["--spares", "1"], pp + ["--chaos-kill", "3:%d:forward" % kill]),
    ("shrink", ["--min-ranks", "2"], pp + ["--chaos-kill", "3:%d:forward" % kill]),
    ("shrink-commit", ["--min-ranks", "2"], pp + ["--chaos-kill", "1:%d:commit" % kill]),
    ("zero1", ["--min-ranks", "2"], ["--dp", "4", "--zero", "1", "--replica-interval", "1",
                                     "--chaos-kill", "2:%d:forward" % kill]),
    ("zero3", ["--min-ranks", "2"], ["--dp", "4", "--zero", "3", "--replica-interval", "1",
                                     "--chaos-kill", "2:%d:forward" % kill]),
]


def run(name, launch, extra):
    argv = [troupe, "launch", "-n", "4"] + launch + [
        "--job", "bench-shrink-%s-%d" % (name, os.getpid()), "--", troupe] + common + extra
    return run_timed(argv)


def report(name, rc, lines):
    _, trained = first(lines, "trained to step")
    tps = re.search(r"\(([0-9.]+) tokens/s\)", trained or "")
    out = "%-13s rc %d  %s tokens/s" % (name, rc, tps.group(1) if tps else "?")
    tk, _ = first(lines, "elastic.chaos_kill")
    tr, rec = first(lines, "elastic: rank")
    ts, done = first(lines, "elastic: step")
    if tk is not None and tr is not None and ts is not None:
        took = re.search(r"recovery took ([0-9.]+) s", rec)
        plan = re.search(r"shrank ([^,]+)", rec)
        frm = re.search(r"going on from step ([0-9]+)", rec)
        lost = re.search(r"lost in step ([0-9]+)", rec)
        out += ("  %s; kill -> recovery line %.3f s (recovery itself %s s), kill -> step %s "
                "completed %.3f s; steps run again %d" % (
                    plan.group(1) if plan else "replaced", tr - tk, took.group(1) if took else "?",
                    re.search(r"step ([0-9]+) completed", done).group(1), ts - tk,
                    int(lost.group(1)) - int(frm.group(1)) if frm and lost else -1))
    print(out, flush=True)
    if rc != 0:
        print("\n".join(l for _, l in lines[-20:]))


print("%d steps, kill at step %d; load average before: %s" % (
    steps, kill, " ".join(open("/proc/loadavg").read().split()[:3])), flush=True)
for k in range(rounds):
    for name, launch, extra in rows if k % 2 == 0 else rows[::-1]:
        rc, lines = run(name, launch, extra)
        report(name, rc, lines)
print("load average after:", " ".join(open("/proc/loadavg").read().split()[:3]))
