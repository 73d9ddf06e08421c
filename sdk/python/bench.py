"""Benchmark of the Python client (not a test): MB/s of `publish_many`, of `publish` and of
an ordered subscriber, 1 KiB messages, order 2, ack 1, against a running server; with
--rust-bench, `embarcadero bench` runs against the same server first, for the ratios.

    python bench.py --control 127.0.0.1:12140 --rust-bench target/release/embarcadero

Each run publishes --total-bytes to a memory-only topic of its own (as `embarcadero bench`
does by default, rf 1), so keep it well below the region's log memory (4 brokers x 24 x 8
MiB by default): old topics are reclaimed as new data needs the room.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import uuid
from typing import Dict, List

from embarcadero import Admin, Publisher, Subscriber

MB = 1e6


def new_topic(control: str, kind: str) -> str:
    name = f"pybench-{kind}-{uuid.uuid4().hex[:8]}"
    Admin(control).create_topic(name, order=2, memory_only=True)
    return name


def publish_many(control: str, topic: str, count: int, size: int, chunk: int) -> float:
    """Seconds from the first message to the last acknowledgement (close flushes)."""
    batch = [os.urandom(size)] * chunk
    with Publisher(control, topic, ack_level=1) as p:
        start = time.perf_counter()
        for _ in range(count // chunk):
            p.publish_many(batch)
        p.publish_many(batch[: count % chunk])
        p.flush()
        return time.perf_counter() - start


def publish_each(control: str, topic: str, count: int, size: int) -> float:
    message = os.urandom(size)
    with Publisher(control, topic, ack_level=1) as p:
        publish = p.publish
        start = time.perf_counter()
        for _ in range(count):
            publish(message)
        p.flush()
        return time.perf_counter() - start


def subscribe(control: str, topic: str, count: int, many: bool) -> float:
    """Seconds for one subscriber to read `count` messages from position 0 (`for m in sub`,
    or `poll_many` with `many`), touching each payload's length."""
    with Subscriber(control, topic) as sub:
        received = 0
        start = time.perf_counter()
        if many:
            while received < count:
                for m in sub.poll_many(timeout=30):
                    received += len(m.payload) > 0
        else:
            for m in sub:
                received += len(m.payload) > 0
                if received == count:
                    break
        return time.perf_counter() - start


def rust_bench(binary: str, control: str, total: int, size: int) -> Dict[str, float]:
    """`embarcadero bench --mode subscribe` against the same server: it publishes, then
    reads everything with one subscriber."""
    cmd = [
        binary,
        "bench",
        "--control",
        control,
        "--mode",
        "subscribe",
        "--order",
        "2",
        "--ack",
        "1",
        "--size",
        str(size),
        "--total-bytes",
        str(total),
        "--no-ceilings",
        "--json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    figures = json.loads(out)
    return {
        "publish": figures["publish_mb_per_s"],
        "subscribe": figures["payload_bytes"] / figures["subscribe_only_seconds"] / MB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default="127.0.0.1:12140")
    parser.add_argument("--size", type=int, default=1024, help="message bytes")
    parser.add_argument("--total-bytes", type=int, default=256 << 20, help="per measurement")
    parser.add_argument("--chunk", type=int, default=1024, help="messages per publish_many")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--rust-bench",
        metavar="EMBARCADERO_BIN",
        help="also run `embarcadero bench` against the same server",
    )
    args = parser.parse_args()
    count = args.total_bytes // args.size
    payload_mb = count * args.size / MB
    rows: List[Dict[str, float]] = []
    for _ in range(args.runs):
        row: Dict[str, float] = {}
        if args.rust_bench:
            rust = rust_bench(args.rust_bench, args.control, args.total_bytes, args.size)
            row["rust publish"], row["rust subscribe"] = rust["publish"], rust["subscribe"]
        topic = new_topic(args.control, "many")
        row["publish_many"] = payload_mb / publish_many(
            args.control, topic, count, args.size, args.chunk
        )
        row["subscribe (for m in sub)"] = payload_mb / subscribe(args.control, topic, count, False)
        row["subscribe (poll_many)"] = payload_mb / subscribe(args.control, topic, count, True)
        topic = new_topic(args.control, "each")
        row["publish"] = payload_mb / publish_each(args.control, topic, count, args.size)
        rows.append(row)
        print(json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
    if args.rust_bench:
        for name, base in [
            ("publish_many", "rust publish"),
            ("publish", "rust publish"),
            ("subscribe (for m in sub)", "rust subscribe"),
            ("subscribe (poll_many)", "rust subscribe"),
        ]:
            ratios = ", ".join(f"{r[name] / r[base]:.0%}" for r in rows)
            print(f"{name}: {ratios} of the Rust client")


if __name__ == "__main__":
    main()
