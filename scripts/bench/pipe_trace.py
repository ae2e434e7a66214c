#!/usr/bin/env python3
"""Pipeline bubble from the runner's traces (--pipe-trace, models/parallel/pipeline_runner.hpp).

    python3 scripts/bench/pipe_trace.py PREFIX [FIRST_STEP]

reads PREFIX.stage<s>.<pid>.txt (one file per stage; lines "step kind microbatch chunk start_ms
end_ms [cpu_ms]", "step wall -1 -1 0 wall_ms [0]" and "step t0 -1 -1 0 start_ms 0", the step's
start on the host's monotonic clock) and prints, over the steps from FIRST_STEP (default 2):

  per stage   mean forward and backward of a microbatch (ms), and the bubble measured two ways:
              of the pipelined section (1 - compute / the stage's action list time, the runner's
              bubble_fraction()) and of forward_backward (1 - compute / wall: the tied-gradient
              exchange and the loss hand-off after the schedule count as idle too)
  replay      the same action lists replayed with each action's measured compute time and free,
              instant transfers: the bubble the schedule alone implies for these compute times
              (stage imbalance and compute jitter included, transfers and wake-ups excluded), as
              sum(idle) / (stages x makespan), the definition of (p-1)/(m+p-1)
  cpu         when the trace has the compute actions' thread CPU times: per stage the mean CPU
              forward and backward, and the replay with those CPU times instead of the wall times:
              the bubble the schedule implies for the stages' own compute cost, without the time
              other processes of a shared machine took from the ranks; and with every action at
              its stage's mean CPU forward or backward: the stages' imbalance alone
  one clock   with the t0 lines: the stages' actions on one time line, and the bubble as the
              formula defines it: sum over stages of idle / (stages x makespan), the makespan
              from the first stage's start to the last stage's last action; a stage's time before
              its own start counts as idle (the per-stage figures above start at each stage's own
              start, so a stage entering its step late looks less idle there)
  theory      (p-1)/(v m+p-1): the bubble of GPipe and 1F1B with equal forwards and backwards.
              Traces of the zero-bubble schedule have weight actions (a split backward's
              parameter gradients): they count as compute like forward and backward, and the
              replay line gives what that schedule implies; the theory line stays 1F1B's, the
              figure the split is meant to beat

The gap between measured and replay is what the runtime adds: transfer time, waiting for a
message that arrived while the waiter was not running, and the sends' completion.
"""
import collections
import glob
import re
import sys

COMPUTE = ("forward", "backward", "weight")  # the actions that occupy a stage


def load(prefix):
    stages = {}
    for path in glob.glob(prefix + ".stage*.txt"):
        m = re.search(r"\.stage(\d+)\.\d+\.txt$", path)
        if not m:
            continue
        steps = collections.defaultdict(list)
        with open(path) as f:
            for line in f:
                step, kind, mb, chunk, start, end, *cpu = line.split()
                cpu = float(cpu[0]) if cpu else -1.0
                steps[int(step)].append((kind, int(mb), int(chunk), float(start), float(end), cpu))
        stages[int(m.group(1))] = steps
    if not stages:
        sys.exit(f"pipe_trace: no trace files {prefix}.stage*.txt")
    return [stages[s] for s in sorted(stages)]


def replay(step_lists, p, use_cpu=False):
    """Makespan and per-stage busy time of the compute actions replayed with free transfers (the
    durations: wall times, or with use_cpu the thread CPU times)."""
    v = 1 + max(a[2] for acts in step_lists for a in acts)
    done = {}  # (kind, microbatch, virtual stage) -> end time
    lists = [[(k, mb, c, 0.0, cpu if use_cpu else e - a) for (k, mb, c, a, e, cpu) in acts
              if k in COMPUTE] for acts in step_lists]
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                kind, mb, c, start, end = lists[s][pos[s]]
                k = c * p + s
                if kind == "forward":
                    dep = ("forward", mb, k - 1) if k > 0 else None
                elif kind == "weight":
                    dep = None  # after its backward, earlier in the same list
                else:
                    dep = ("backward", mb, k + 1) if k < p * v - 1 else ("forward", mb, k)
                if dep is not None and dep not in done:
                    break
                t0 = max(clock[s], done[dep] if dep is not None else 0.0)
                clock[s] = t0 + (end - start)
                busy[s] += end - start
                done[(kind, mb, k)] = clock[s]
                pos[s] += 1
                progress = True
    if any(pos[s] < len(lists[s]) for s in range(p)):
        sys.exit("pipe_trace: the traced lists do not replay (a dependency never runs)")
    return max(clock), busy, v


def main():
    prefix = sys.argv[1]
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    stages = load(prefix)
    p = len(stages)
    steps = sorted(set.intersection(*[set(s) for s in stages]))
    steps = [t for t in steps if t >= first]
    if not steps:
        sys.exit(f"pipe_trace: no step >= {first} in every stage's trace")
    idle = busy_total = 0.0
    m = v = 1
    all_compute = all_sched = 0.0
    has_cpu = all(a[5] >= 0 for trace in stages for t in steps for a in trace[t])
    cpu_lines, cpu_means = [], []
    for s, trace in enumerate(stages):
        fw = bw = ww = sched = wall = cf = cb = cw = 0.0
        nf = nb = nw = 0
        for t in steps:
            acts = trace[t]
            sched += max(a[4] for a in acts if a[0] not in ("wall", "t0"))
            wall += sum(a[4] for a in acts if a[0] == "wall")
            for k, _, _, a, e, cpu in acts:
                if k == "forward":
                    fw, nf, cf = fw + e - a, nf + 1, cf + cpu
                elif k == "backward":
                    bw, nb, cb = bw + e - a, nb + 1, cb + cpu
                elif k == "weight":
                    ww, nw, cw = ww + e - a, nw + 1, cw + cpu
        compute = fw + bw + ww
        all_compute, all_sched = all_compute + compute, all_sched + sched
        split = f" (input gradient only), weight pass {ww / nw:.2f} ms" if nw else ""
        print(f"  stage {s}: forward {fw / nf:.2f} ms, backward {bw / nb:.2f} ms{split}; bubble "
              f"{100 * (1 - compute / sched):.1f}% of the pipelined section, "
              f"{100 * (1 - compute / wall):.1f}% of forward_backward")
        cpu_lines.append(f"  stage {s}: CPU forward {cf / nf:.2f} ms, backward {cb / nb:.2f} ms"
                         + (f", weight pass {cw / nw:.2f} ms" if nw else ""))
        cpu_means.append((cf / nf, cb / nb, cw / nw if nw else 0.0))
    cpu_idle = cpu_total = 0.0
    for t in steps:
        span, busy, v = replay([trace[t] for trace in stages], p)
        m = sum(1 for a in stages[0][t] if a[0] == "forward") // v
        idle += p * span - sum(busy)
        busy_total += p * span
        if has_cpu:
            span, busy, _ = replay([trace[t] for trace in stages], p, use_cpu=True)
            cpu_idle += p * span - sum(busy)
            cpu_total += p * span
    ideal = (p - 1) / (v * m + p - 1)
    has_t0 = all(any(a[0] == "t0" for a in trace[t]) for trace in stages for t in steps)
    one_idle = one_total = 0.0
    if has_t0:
        for t in steps:
            starts = [next(a[4] for a in trace[t] if a[0] == "t0") for trace in stages]
            ends = [s0 + max(a[4] for a in trace[t] if a[0] not in ("wall", "t0"))
                    for s0, trace in zip(starts, stages)]
            span = max(ends) - min(starts)
            busy = sum(a[4] - a[3] for trace in stages for a in trace[t] if a[0] in COMPUTE)
            one_idle += p * span - busy
            one_total += p * span
    print(f"  all stages: bubble {100 * (1 - all_compute / all_sched):.1f}% of the pipelined "
          "section (idle over the stages' summed section time)")
    if has_t0:
        print(f"  one clock: bubble {100 * one_idle / one_total:.1f}% (idle over stages x makespan, "
              "from the first stage's start to the last one's end)")
    print(f"  replay with the measured compute times and free transfers: bubble "
          f"{100 * idle / busy_total:.1f}%; theory (p-1)/(v m+p-1) = {100 * ideal:.1f}% "
          f"(p {p}, m {m}, v {v}; steps {steps[0]}..{steps[-1]})")
    if has_cpu:
        # The last step's lists with every forward and backward of a stage at its mean CPU time:
        # what the stages' imbalance alone implies, without the per-action jitter.
        kinds = {"forward": 0, "backward": 1, "weight": 2}
        last = [[(k, mb, c, 0.0, 0.0, cpu_means[s][kinds.get(k, 1)])
                 for (k, mb, c, _, _, _) in trace[steps[-1]]] for s, trace in enumerate(stages)]
        span, busy, _ = replay(last, p, use_cpu=True)
        print("\n".join(cpu_lines))
        print(f"  replay with the compute actions' thread CPU times: bubble "
              f"{100 * cpu_idle / cpu_total:.1f}%; with each stage's mean CPU forward and "
              f"backward: {100 * (p * span - sum(busy)) / (p * span):.1f}%")


if __name__ == "__main__":
    main()
