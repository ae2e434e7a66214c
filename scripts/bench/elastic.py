#!/usr/bin/env python3
"""Elastic recovery on this machine (issue 17's benchmark): the demo GPT (gpt2-demo, B=8 T=128)
as dp2 x pp2 on 4 ranks, trained STEPS steps

  plain     not elastic (the baseline: one-phase steps, direct allreduce, shared memory)
  elastic   --elastic with 1 spare, no fault: what elasticity costs per step (two-phase steps, a
            second driver round trip; ring/recursive-doubling allreduce instead of the direct
            one; tcp loopback instead of shared memory between local ranks)
  forward   the same with rank 3 SIGKILLing itself before its forward pass of step KILL
  commit    the same with rank 1 SIGKILLing itself at its commit of step KILL
  buddy1    elastic with buddy replicas every step (--replica-interval 1), no fault: the cost of
            copying every rank's piece state (weights, m, v) to its buddy and keeping a snapshot
  buddy10   the same every 10 steps

Each output line is timestamped on arrival. For the killed runs it prints the time from the
killed rank's last line (elastic.chaos_kill: printed just before its SIGKILL) to the recovery's
log line and to the completion of the first step after it ("elastic: step N completed ..."), and
the steps lost (0: the abandoned step is run again, nothing committed is lost). Tokens/s are the
driver's over the whole run (the recovery included for the killed runs). Load average before and
after: on the shared 2-vCPU machine every figure needs it next to it.

  python3 scripts/bench/elastic.py [build-dir] [steps] [kill-step]
"""
import os
import re
import sys

from timed_lines import first, run_timed

build = sys.argv[1] if len(sys.argv) > 1 else "build"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
kill = int(sys.argv[3]) if len(sys.argv) > 3 else 30
troupe = os.path.join(build, "apps", "troupe")
common = ["train", "--model", "gpt2-demo", "--batch", "8", "--seq", "128", "--steps", str(steps),
          "--dp", "2", "--pp", "2", "--microbatches", "4", "--sample", "0", "--log-every", "1000",
          "--threads", "1"]


def run(name, spares, extra):
    argv = [troupe, "launch", "-n", "4", "--spares", str(spares), "--job",
            "bench-elastic-%s-%d" % (name, os.getpid()), "--", troupe] + common + extra
    return run_timed(argv)


print("load average before:", " ".join(open("/proc/loadavg").read().split()[:3]))
for name, spares, extra in [
        ("plain", 0, []),
        ("elastic", 1, ["--elastic"]),
        ("forward", 1, ["--elastic", "--chaos-kill", "3:%d:forward" % kill]),
        ("commit", 1, ["--elastic", "--chaos-kill", "1:%d:commit" % kill]),
        ("buddy1", 1, ["--elastic", "--replica-interval", "1"]),
        ("buddy10", 1, ["--elastic", "--replica-interval", "10"])]:
    rc, lines = run(name, spares, extra)
    _, trained = first(lines, "trained to step")
    tps = re.search(r"\(([0-9.]+) tokens/s\)", trained or "")
    out = "%-8s rc %d  %s tokens/s" % (name, rc, tps.group(1) if tps else "?")
    tk, _ = first(lines, "elastic.chaos_kill")
    tr, rec = first(lines, "took its place")
    ts, done = first(lines, "elastic: step")
    if tk is not None and tr is not None and ts is not None:
        took = re.search(r"recovery took ([0-9.]+) s", rec)
        frm = re.search(r"going on from step ([0-9]+)", rec)
        lost = re.search(r"lost in step ([0-9]+)", rec)
        # Steps run again: the abandoned step (lost before its commit), or none (lost at its
        # commit, which the others completed). Committed steps are never lost.
        out += ("  kill -> recovery line %.3f s (recovery itself %s s), kill -> step %s completed "
                "%.3f s; steps run again %d" % (tr - tk, took.group(1), re.search(
                    r"step ([0-9]+) completed", done).group(1), ts - tk,
                    int(lost.group(1)) - int(frm.group(1)) if frm and lost else -1))
    print(out)
    if rc != 0:
        print("\n".join(l for _, l in lines[-20:]))
print("load average after:", " ".join(open("/proc/loadavg").read().split()[:3]))
