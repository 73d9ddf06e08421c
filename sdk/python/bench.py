"""Benchmark of the Python client (not a test): MB/s of `publish_many`, of `publish` and of
an ordered subscriber, 1 KiB messages, order 2, ack 1, against a running server; with
--rust-bench, `embarcadero bench` runs against the same server first, for the ratios.

    python bench.py --control 127.0.0.1:12140 --rust-bench target/release/embarcadero

With --perf FILE, `perf record -a -g` runs while the `for m in sub` reader reads (the whole
machine: `perf report -i FILE --pid PID` for this process, whose id the run prints).

Each run publishes --total-bytes to a memory-only topic of its own (as `embarcadero bench`
does by default, rf 1), so keep it well below the region's log memory (4 brokers x 24 x 8
MiB by default): old topics are reclaimed as new data needs the room.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Tuple

from embarcadero import Admin, Publisher, Subscriber

MB = 1e6


class Timed:
    """Wall seconds, this process's CPU seconds (every thread: the client's sender and
    reader threads too) and its page faults (fresh memory touched) of a `with` block."""

    def __enter__(self) -> Timed:
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults


class Perf:
    """`perf record -a -g` into `out` while a `with` block runs (nothing if `out` is None)."""

    def __init__(self, out: Optional[str]) -> None:
        self.out = out
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> Perf:
        if self.out:
            cmd = ["perf", "record", "-a", "-g", "-F", "999", "-o", self.out]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"perf record -> {self.out}; this process is {os.getpid()}", file=sys.stderr)
            # Not a synchronisation: a head start for perf to open its events, so that the
            # profile covers the read from its first message.
            time.sleep(1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait()


def new_topic(control: str, kind: str) -> str:
    name = f"pybench-{kind}-{uuid.uuid4().hex[:8]}"
    Admin(control).create_topic(name, order=2, memory_only=True)
    return name


def publish_many(control: str, topic: str, count: int, size: int, chunk: int) -> Timed:
    """From the first message to the last acknowledgement."""
    batch = [os.urandom(size)] * chunk
    with Publisher(control, topic, ack_level=1) as p, Timed() as timed:
        for _ in range(count // chunk):
            p.publish_many(batch)
        p.publish_many(batch[: count % chunk])
        p.flush()
    return timed


def publish_each(control: str, topic: str, count: int, size: int) -> Timed:
    message = os.urandom(size)
    with Publisher(control, topic, ack_level=1) as p, Timed() as timed:
        publish = p.publish
        for _ in range(count):
            publish(message)
        p.flush()
    return timed


def refuse_skipped(sub: Subscriber) -> None:
    """Fails the run when the topic's start was reclaimed before the reader came: the
    messages it waits for would never come. Known once the first delivery has arrived."""
    skipped = sub.skipped
    if skipped:
        raise SystemExit(
            f"positions {skipped[0]}..{skipped[1]} were reclaimed before the subscriber "
            "started: a memory-only topic keeps about three quarters of each broker's log "
            "memory; lower --total-bytes"
        )


def subscribe(
    control: str, topic: str, count: int, how: str, perf: Optional[str] = None
) -> Timed:
    """One subscriber reading `count` messages from position 0: `for m in sub` (`how`
    "each"), `poll_many` ("many"), each touching its payload's length; or `poll_batch`
    ("batch"), which sums the batch's payload lengths in native code (one per message, as
    the Rust reader's callback counts each message) and makes no `Message`. Profiled into
    `perf`."""
    with Subscriber(control, topic) as sub, Perf(perf), Timed() as timed:
        received = payload_bytes = 0
        checked = False
        if how != "each":
            while received < count:
                if how == "many":
                    for m in sub.poll_many(timeout=30):
                        received += len(m.payload) > 0
                else:
                    batch = sub.poll_batch(timeout=30)
                    received += len(batch)
                    payload_bytes += batch.payload_bytes
                if received and not checked:
                    # Once: `skipped` waits for the read-ahead thread's poll.
                    refuse_skipped(sub)
                    checked = True
        else:
            it = iter(sub)
            received += len(next(it).payload) > 0
            refuse_skipped(sub)
            if received < count:  # the first message may have been all of them
                for m in it:
                    received += len(m.payload) > 0
                    if received == count:
                        break
    return timed


def rust_bench(binary: str, control: str, mode: str, total: int, size: int) -> Dict[str, float]:
    """`embarcadero bench --mode MODE` against the same server (mode subscribe publishes,
    then reads everything with one subscriber), and the CPU seconds its process used."""
    cmd = [binary, "bench", "--control", control, "--mode", mode, "--order", "2", "--ack"]
    cmd += ["1", "--size", str(size), "--total-bytes", str(total), "--no-ceilings", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = json.loads(out)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seconds = figures["subscribe_only_seconds"] if mode == "subscribe" else None
    return {
        "publish": figures["publish_mb_per_s"],
        "subscribe": figures["payload_bytes"] / seconds / MB if seconds else 0.0,
        "cpu": cpu,
    }


def measure(args: argparse.Namespace, count: int) -> List[Tuple[str, Timed]]:
    """The measurements of one run (all, or the one --only names)."""
    measured = []
    if args.only in (None, "publish_many", "subscribe"):
        topic = new_topic(args.control, "many")
        many = publish_many(args.control, topic, count, args.size, args.chunk)
        if args.only != "subscribe":
            measured.append(("publish_many", many))
        if args.only != "publish_many":
            each = subscribe(args.control, topic, count, "each", args.perf)
            measured.append(("subscribe (for m in sub)", each))
            many = subscribe(args.control, topic, count, "many")
            measured.append(("subscribe (poll_many)", many))
            batch = subscribe(args.control, topic, count, "batch")
            measured.append(("subscribe (poll_batch)", batch))
    if args.only in (None, "publish"):
        topic = new_topic(args.control, "each")
        measured.append(("publish", publish_each(args.control, topic, count, args.size)))
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default="127.0.0.1:12140")
    parser.add_argument("--size", type=int, default=1024, help="message bytes")
    parser.add_argument("--total-bytes", type=int, default=256 << 20, help="per measurement")
    parser.add_argument("--chunk", type=int, default=1024, help="messages per publish_many")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--only",
        choices=["publish_many", "publish", "subscribe"],
        help="run one measurement (subscribe: fill a topic, then both readers)",
    )
    parser.add_argument(
        "--rust-bench",
        metavar="EMBARCADERO_BIN",
        help="also run `embarcadero bench` against the same server",
    )
    parser.add_argument(
        "--perf", metavar="FILE", help="perf record -a -g while `for m in sub` reads"
    )
    args = parser.parse_args()
    count = args.total_bytes // args.size
    payload_mb = count * args.size / MB
    gb = count * args.size / 1e9
    rows: List[Dict[str, float]] = []
    for _ in range(args.runs):
        row: Dict[str, float] = {}
        if args.rust_bench:
            pub = rust_bench(args.rust_bench, args.control, "publish", args.total_bytes, args.size)
            both = rust_bench(
                args.rust_bench, args.control, "subscribe", args.total_bytes, args.size
            )
            row["rust publish"] = pub["publish"]
            row["rust subscribe"] = both["subscribe"]
            # The process's CPU per GB, for publishing and (by difference) subscribing.
            row["rust publish cpu s/GB"] = pub["cpu"] / gb
            row["rust subscribe cpu s/GB"] = (both["cpu"] - pub["cpu"]) / gb
        measured = measure(args, count)
        for name, timed in measured:
            row[name] = payload_mb / timed.wall
            row[f"{name} cpu s/GB"] = timed.cpu / gb
            row[f"{name} faults/MB"] = timed.faults / payload_mb
        rows.append(row)
        print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    if args.rust_bench:
        for name, base in [
            ("publish_many", "rust publish"),
            ("publish", "rust publish"),
            ("subscribe (for m in sub)", "rust subscribe"),
            ("subscribe (poll_many)", "rust subscribe"),
            ("subscribe (poll_batch)", "rust subscribe"),
        ]:
            ratios = ", ".join(f"{r[name] / r[base]:.0%}" for r in rows)
            print(f"{name}: {ratios} of the Rust client's MB/s")


if __name__ == "__main__":
    main()
