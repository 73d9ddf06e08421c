#!/usr/bin/env python3
"""Issue 26's bars in one interleaved run (a benchmark, not a test): each round runs
`embarcadero bench` (an embedded server per run, 1 KiB messages, 4 brokers, ack 1) for

- publish-only over shared memory, order 2 with the machine's ceilings measured right
  after it (memcpy is the bar's denominator), then orders 0 and 5;
- publish + one ordered subscriber (`--mode e2e`), order 2, against that round's
  publish-only;
- append-to-ack latency at a fixed low rate (default 460 MB/s, a tenth of publish-only
  here), order 2, linger 0, over shared memory;
- CPU per GB at one fixed rate (default 2000 MB/s) over TCP and over shared memory;

in an order that alternates from round to round, and records `/proc/loadavg` before each.
The ratios that count are those of one round; the summary gives their medians and each
round's, against the bars. docs/PERFORMANCE.md says what each bar is and where it stands.

    scripts/shm-bench.py --bin target/release/embarcadero --rounds 5 --out /tmp/shm.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from typing import Callable, Dict, List

from bench_rounds import run_rounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(binary: str, flags: str) -> dict:
    """One `embarcadero bench FLAGS --json` run (ack 1, 1 KiB, 4 brokers); its JSON."""
    cmd = [
        binary,
        "bench",
        "--ack",
        "1",
        "--size",
        "1024",
        "--brokers",
        "4",
        "--json",
        *flags.split(),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def memcpy_of(run: dict) -> float:
    """The memcpy ceiling (MB/s) that a run with ceilings measured."""
    for c in run["ceilings"]:
        if c["name"].startswith("memcpy"):
            return c["mb_per_s"]
    raise SystemExit("the run measured no memcpy ceiling")


def publish_steps(args: argparse.Namespace) -> List[Callable[[], Dict[str, float]]]:
    """Publish-only over shared memory, orders 2 (with ceilings), 0 and 5."""
    common = f"--mode publish --transport shm --total-bytes {args.total_bytes}"

    def order2() -> Dict[str, float]:
        run = bench(args.bin, f"{common} --order 2")
        return {"shm order 2": run["mb_per_s"], "memcpy": memcpy_of(run)}

    def other(order: int) -> Callable[[], Dict[str, float]]:
        def step() -> Dict[str, float]:
            run = bench(args.bin, f"{common} --order {order} --no-ceilings")
            return {f"shm order {order}": run["mb_per_s"]}

        return step

    return [order2, other(0), other(5)]


def e2e_step(args: argparse.Namespace) -> Dict[str, float]:
    """Publish + one ordered subscriber over shared memory, order 2."""
    flags = f"--mode e2e --order 2 --transport shm --total-bytes {args.total_bytes} --no-ceilings"
    return {"shm e2e": bench(args.bin, flags)["mb_per_s"]}


def latency_step(args: argparse.Namespace) -> Dict[str, float]:
    """Append-to-ack at a low fixed rate, order 2, linger 0, over shared memory."""
    flags = f"--mode publish --order 2 --transport shm --rate {args.rate_mb} --linger-us 0"
    run = bench(args.bin, f"{flags} --warmup-messages 20000 --duration 6 --no-ceilings")
    lat = run["append_to_ack_us"]
    return {"p50 us": lat["p50"], "p99 us": lat["p99"], "epoch us": run["epoch_us"]}


def cpu_step(args: argparse.Namespace, transport: str) -> Callable[[], Dict[str, float]]:
    """CPU per GB (server and client) at one fixed rate over `transport`."""

    def step() -> Dict[str, float]:
        flags = f"--mode publish --order 2 --transport {transport} --rate {args.same_rate_mb}"
        run = bench(args.bin, f"{flags} --total-bytes {args.total_bytes} --no-ceilings")
        return {f"{transport} cpu s/GB": run["process_cpu_seconds_per_gb"]}

    return step


@dataclass
class Bar:
    """One of the issue's bars: a round's figure for it, and whether that meets it."""

    name: str
    figure: Callable[[Dict[str, float]], float]
    bar: str
    met: Callable[[float, Dict[str, float]], bool]
    shown: Callable[[float], str]


def percent(v: float) -> str:
    return f"{v:.0%}"


def micros(v: float) -> str:
    return f"{v:.0f}"


def times(v: float) -> str:
    return f"{v:.2f}x"


def ratio(numerator: str, denominator: str) -> Callable[[Dict[str, float]], float]:
    return lambda r: r[numerator] / r[denominator]


def figure(name: str) -> Callable[[Dict[str, float]], float]:
    return lambda r: r[name]


def at_least(bar: float) -> Callable[[float, Dict[str, float]], bool]:
    return lambda v, r: v >= bar


def within(share: float) -> Callable[[float, Dict[str, float]], bool]:
    return lambda v, r: abs(v - 1) <= share


def within_half_epoch(p50: float, r: Dict[str, float]) -> bool:
    return p50 <= r["epoch us"] / 2 + 50


BARS = [
    Bar("order 2 / memcpy", ratio("shm order 2", "memcpy"), ">= 50%", at_least(0.5), percent),
    Bar("order 0 / order 2", ratio("shm order 0", "shm order 2"), "± 10%", within(0.1), percent),
    Bar("order 5 / order 2", ratio("shm order 5", "shm order 2"), "± 10%", within(0.1), percent),
    Bar("e2e / publish", ratio("shm e2e", "shm order 2"), ">= 70%", at_least(0.7), percent),
    Bar("p50 us", figure("p50 us"), "<= epoch/2 + 50", within_half_epoch, micros),
    Bar("p99 us", figure("p99 us"), "< 1000", lambda v, r: v < 1000, micros),
    Bar("tcp cpu / shm cpu", ratio("tcp cpu s/GB", "shm cpu s/GB"), ">= 2x", at_least(2), times),
]


def one_round(args: argparse.Namespace, index: int) -> Dict[str, float]:
    publish = publish_steps(args)
    # The three orders in a rotated order from round to round: one run of each swings by a
    # third, and the order that runs first after the others' runs should not always be the
    # same one (PERFORMANCE.md, session 38).
    turn = index % len(publish)
    steps = publish[turn:] + publish[:turn] + [
        lambda: e2e_step(args),
        lambda: latency_step(args),
        cpu_step(args, "tcp"),
        cpu_step(args, "shm"),
    ]
    if index % 2 == 1:
        # Every other round the other way round, so that a drift of the machine's load
        # during a round favours no step.
        steps.reverse()
    row: Dict[str, float] = {"round": index + 1}
    loads = []
    for step in steps:
        with open("/proc/loadavg") as f:
            loads.append(float(f.read().split()[0]))
        row.update(step())
    row["loadavg max"] = max(loads)
    for b in BARS:
        row[b.name] = b.figure(row)
    return row


def summary(rows: List[Dict[str, float]]) -> None:
    for b in BARS:
        values = [r[b.name] for r in rows]
        met = sum(b.met(r[b.name], r) for r in rows)
        each = ", ".join(b.shown(v) for v in values)
        median = b.shown(statistics.median(values))
        print(f"{b.name}: median {median} ({each}); bar {b.bar}: met in {met} of {len(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=os.path.join(ROOT, "target/release/embarcadero"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--total-bytes", type=int, default=4_000_000_000)
    parser.add_argument("--rate-mb", type=int, default=460, help="MB/s of the latency runs")
    parser.add_argument("--same-rate-mb", type=int, default=2000, help="MB/s of the CPU runs")
    parser.add_argument("--out", help="append each round as a JSON line here")
    args = parser.parse_args()
    rows = run_rounds(args.rounds, lambda i: one_round(args, i), args.out)
    summary(rows)


if __name__ == "__main__":
    main()
