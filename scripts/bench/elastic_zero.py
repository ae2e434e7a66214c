#!/usr/bin/env python3
"""ZeRO under elastic runs on this machine (issue 17's benchmark for sharded state): the demo GPT
(gpt2-demo, B=8 T=128) as dp4 with ZeRO ZERO on 4 ranks and a spare, trained STEPS steps

  elastic   --elastic, no buddy replicas, no fault: the baseline (a loss could not be recovered)
  buddy1    buddy replicas every step (--replica-interval 1), no fault: the cost of copying every
            rank's shard state (its parameter chunks, m, v) to its buddy over UCX and keeping a
            snapshot of its own
  buddy10   the same every 10 steps
  forward   buddy1 with rank 2 SIGKILLing itself before its forward pass of step KILL
  commit    buddy1 with rank 1 SIGKILLing itself at its commit of step KILL (the others commit,
            so every rank goes back to the replicated step, one step)

The fault-free rows run ROUNDS times, interleaved (elastic, buddy1, buddy10, then the reverse),
so a change of the machine's load hits them alike; with replicas the run's own line gives the
driver's seconds in the replication rounds against the steps' seconds (the direct measure: tokens/s
on this shared machine moves by more than the replication costs). Each output line is timestamped on arrival. For the
killed runs it prints the time from the killed rank's last line (elastic.chaos_kill, printed just
before its SIGKILL) to the recovery's log line and to the completion of the first step after it
("elastic: step N completed ..."), and the steps run again. Tokens/s are the driver's over the
whole run. Load average before and after: on the shared 2-vCPU machine every figure needs it.

  python3 scripts/bench/elastic_zero.py [build-dir] [zero] [steps] [kill-step] [rounds]
"""
import os
import re
import sys

from timed_lines import first, run_timed

build = sys.argv[1] if len(sys.argv) > 1 else "build"
zero = int(sys.argv[2]) if len(sys.argv) > 2 else 1
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 60
kill = int(sys.argv[4]) if len(sys.argv) > 4 else 30
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
troupe = os.path.join(build, "apps", "troupe")
common = ["train", "--model", "gpt2-demo", "--batch", "8", "--seq", "128", "--steps", str(steps),
          "--dp", "4", "--zero", str(zero), "--sample", "0", "--log-every", "1000",
          "--threads", "1", "--elastic"]


def run(name, extra):
    argv = [troupe, "launch", "-n", "4", "--spares", "1", "--job",
            "bench-elastic-zero-%s-%d" % (name, os.getpid()), "--", troupe] + common + extra
    return run_timed(argv)


def report(name, rc, lines):
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
        mb = re.search(r"([0-9.]+) MB over UCX", rec)
        out += ("  kill -> recovery line %.3f s (recovery itself %s s, %s MB), kill -> step %s "
                "completed %.3f s; steps run again %d" % (
                    tr - tk, took.group(1), mb.group(1) if mb else "?",
                    re.search(r"step ([0-9]+) completed", done).group(1), ts - tk,
                    int(lost.group(1)) - int(frm.group(1)) if frm and lost else -1))
    print(out, flush=True)
    if rc != 0:
        print("\n".join(l for _, l in lines[-20:]))
    return float(tps.group(1)) if tps else None


print("zero %d, %d steps, kill at step %d; load average before: %s" % (
    zero, steps, kill, " ".join(open("/proc/loadavg").read().split()[:3])), flush=True)
rates = {}
fault_free = [("elastic", []), ("buddy1", ["--replica-interval", "1"]),
              ("buddy10", ["--replica-interval", "10"])]
for k in range(rounds):  # every other round in reverse order: a run's place in it evens out
    for name, extra in fault_free if k % 2 == 0 else fault_free[::-1]:
        rc, lines = run(name, extra)
        rates.setdefault(name, []).append(report(name, rc, lines))
        _, line = first(lines, "buddy replications")
        if line:
            print("         " + line.split("] ", 1)[-1], flush=True)
for name, extra in [("forward", ["--replica-interval", "1", "--chaos-kill", "2:%d:forward" % kill]),
                    ("commit", ["--replica-interval", "1", "--chaos-kill", "1:%d:commit" % kill])]:
    rc, lines = run(name, extra)
    report(name, rc, lines)
base = [r for r in rates["elastic"] if r]
for name in ("buddy1", "buddy10"):
    got = [r for r in rates[name] if r]
    if base and got:
        print("%s: %.3f of elastic's tokens/s (mean of %d runs each)" % (
            name, (sum(got) / len(got)) / (sum(base) / len(base)), len(got)))
print("load average after:", " ".join(open("/proc/loadavg").read().split()[:3]))
