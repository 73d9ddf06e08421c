#!/usr/bin/env python3
"""Where a workflow task's time goes, from the trace of EMBARCADERO_WORKFLOW_TRACE.

Each line: `role position kind task step attempt publish_ns read_ns` (crates/workflow/src/trace.rs),
one per event per process that read it. For every task, its events in log order make a chain:
each event is published, travels through the log (publish -> read by the process that publishes
the next one: a trip), and that process reacts by publishing the next event (a reaction). An
event published before its predecessor was read by that process went out with it (a worker's
claim ahead right behind its result): no trip, only the gap between the two publishes.
Prints, over all tasks, the median and p95 of each trip and reaction, in microseconds, and of
a task's whole chain (task_created published -> its last event read by the orchestrator).

Usage: scripts/workflow_trace.py TRACE_FILE [--skip N]  (skip the first N tasks: warm-up)
"""
import sys
from collections import defaultdict

# Who publishes events of this kind.
PUBLISHER = {
    "task_created": "orchestrator",  # its API
    "step_enqueued": "orchestrator",
    "step_claimed": "worker",
    "step_result": "worker",
    "step_completed": "orchestrator",
}


def pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def load(path):
    events = {}  # position -> dict
    for line in open(path):
        parts = line.split()
        if len(parts) != 8:
            continue
        role, pos, kind, task, step, attempt, pub, read = parts
        e = events.setdefault(int(pos), {"kind": kind, "task": task, "step": step,
                                          "attempt": attempt, "pub": int(pub), "read": {}})
        who = "orchestrator" if role == "orchestrator" else "worker"
        e["read"][who] = min(e["read"].get(who, 1 << 63), int(read))
    return events


def main():
    path = sys.argv[1]
    skip = int(sys.argv[sys.argv.index("--skip") + 1]) if "--skip" in sys.argv else 0
    events = load(path)
    chains = defaultdict(list)
    for pos in sorted(events):
        e = events[pos]
        if e["task"] != "-" and e["kind"] in PUBLISHER:
            chains[e["task"]].append(e)
    order = sorted(chains, key=lambda t: chains[t][0]["pub"])[skip:]
    trips, reactions, totals, counts = defaultdict(list), defaultdict(list), [], []
    for task in order:
        chain = chains[task]
        if chain[0]["kind"] != "task_created":
            continue
        for a, b in zip(chain, chain[1:]):
            actor = PUBLISHER[b["kind"]]
            if actor not in a["read"]:
                continue
            if b["pub"] < a["read"][actor]:
                reactions[f'{a["kind"]} + {b["kind"]} (published together)'].append((b["pub"] - a["pub"]) / 1e3)
                continue
            trips[f'{a["kind"]} (read by the {actor})'].append((a["read"][actor] - a["pub"]) / 1e3)
            reactions[f'{a["kind"]} -> {b["kind"]}'].append((b["pub"] - a["read"][actor]) / 1e3)
        last = chain[-1]
        if "orchestrator" in last["read"]:
            trips[f'{last["kind"]} (last, read by the orchestrator)'].append(
                (last["read"]["orchestrator"] - last["pub"]) / 1e3)
            totals.append((last["read"]["orchestrator"] - chain[0]["pub"]) / 1e3)
            counts.append(len(chain))
    print(f"tasks: {len(totals)}; events per task (median): {pct(counts, 0.5)}")
    print(f"{'trip through the log (publish -> read by its actor)':58} {'n':>5} {'p50 us':>8} {'p95 us':>8}")
    for k, v in sorted(trips.items()):
        print(f"  {k:56} {len(v):5} {pct(v, 0.5):8.0f} {pct(v, 0.95):8.0f}")
    print(f"{'reaction (read -> next event published)':58}")
    for k, v in sorted(reactions.items()):
        print(f"  {k:56} {len(v):5} {pct(v, 0.5):8.0f} {pct(v, 0.95):8.0f}")
    all_trips = [x for v in trips.values() for x in v]
    all_reacts = [x for v in reactions.values() for x in v]
    per_task = sum(len(v) for v in trips.values()) / max(1, len(totals))
    print(f"trips per task {per_task:.1f}, trip p50 {pct(all_trips, 0.5):.0f} us; "
          f"reaction p50 {pct(all_reacts, 0.5):.0f} us")
    print(f"chain (task_created published -> last event read by the orchestrator): "
          f"p50 {pct(totals, 0.5) / 1e3:.2f} ms, p95 {pct(totals, 0.95) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
