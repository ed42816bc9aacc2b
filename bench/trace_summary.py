#!/usr/bin/env python3
"""Summarizes a trace that fwd_bwd_bench --trace wrote (bench/trace.h): the step's span, the CPU
ops by self time (an op's time less its children's on the same thread), and, from a GPU run, how
long the GPU was busy (the union of its kernels' intervals over all streams) and the kernels by
total time. A GPU busy for much less than the span waits on the host: on launches, or on host
work between them. Standard library only.

usage: bench/trace_summary.py TRACE_JSON [--top N]
"""
import argparse
import collections
import json


def self_times(ops):
    """Per name: [self µs, calls] over the complete events [(ts, dur, name)] of one thread, nested
    as their intervals are."""
    totals = collections.defaultdict(lambda: [0.0, 0])
    stack = []  # open events: [end, name, own duration, children's time]

    def close():
        end, name, dur, children = stack.pop()
        totals[name][0] += dur - children

    for ts, dur, name in sorted(ops, key=lambda o: (o[0], -o[1])):
        while stack and stack[-1][0] <= ts:
            close()
        end = ts + dur
        if stack:
            # A child reported past its parent's end (clocks read apart) counts to that end only.
            end = min(end, stack[-1][0])
            stack[-1][3] += end - ts
        stack.append([end, name, end - ts, 0.0])
        totals[name][1] += 1
    while stack:
        close()
    return totals


def union_us(intervals):
    """Length of the union of [start, end) intervals."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


def summarize(events, top):
    lines = []
    xs = [e for e in events if e.get("ph") == "X"]
    if not xs:
        return ["no complete events"]
    span = max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)
    lines.append(f"span {span / 1e3:.3f} ms, {len(xs)} events")
    by_thread = collections.defaultdict(list)
    for e in xs:
        if e.get("cat") == "cpu_op":
            by_thread[e["tid"]].append((e["ts"], e["dur"], e["name"]))
    cpu = collections.defaultdict(lambda: [0.0, 0])
    for ops in by_thread.values():
        for name, (t, n) in self_times(ops).items():
            cpu[name][0] += t
            cpu[name][1] += n
    lines.append("")
    lines.append("| CPU op | self ms | calls |")
    lines.append("|---|---:|---:|")
    for name, (t, n) in sorted(cpu.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name} | {t / 1e3:.3f} | {n} |")
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    if kernels:
        busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        lines.append("")
        share = 100 * busy / span if span > 0 else 0.0
        mean = sum(e["dur"] for e in kernels) / len(kernels)
        lines.append(f"GPU busy {busy / 1e3:.3f} ms of the span ({share:.1f}%), "
                     f"{len(kernels)} kernels and copies, mean {mean:.1f} µs")
        by_name = collections.defaultdict(lambda: [0.0, 0])
        for e in kernels:
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
        lines.append("")
        lines.append("| kernel | ms | calls | share of busy |")
        lines.append("|---|---:|---:|---:|")
        for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            of_busy = 100 * t / busy if busy > 0 else 0.0
            lines.append(f"| {name[:100]} | {t / 1e3:.3f} | {n} | {of_busy:.1f}% |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    print("\n".join(summarize(events, args.top)))


if __name__ == "__main__":
    main()
