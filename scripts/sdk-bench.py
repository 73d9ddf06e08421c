#!/usr/bin/env python3
"""Benchmark of the SDKs against the Rust client (not a test), interleaved: each round starts
a fresh `embarcadero serve` (region in /dev/shm, large enough to keep a whole --sub-mb topic
of 1 KiB messages, order 2, memory-only) and runs, against it, the Rust client
(`embarcadero bench`), the TypeScript client (sdk/typescript/bench.mjs) and the Python client
(sdk/python/bench.py), each publishing many at a time, one by one and reading, in an order
that alternates from round to round, and records `/proc/loadavg` before each. The ratios
that count are those of the same round; the summary gives their medians. Issue 24,
docs/PERFORMANCE.md.

    scripts/sdk-bench.py --bin target/release/embarcadero --python VENV/bin/python \\
        --rounds 5 --pub-mb 1024 --sub-mb 1024 --out /tmp/sdk-bench.jsonl

--no-typescript leaves TypeScript out; --python-base OTHER_VENV/bin/python adds the Python
subscriber of another build of the binding to each round (an A/B in the same rounds);
--ts-base DIR does the same for TypeScript: DIR is another copy of sdk/typescript with its
release addon and TypeScript built, whose publishers and subscribers run in each round too
(labelled "base ts").

Needs the release addon and TypeScript built (`npm run build:native:release && npm run
build:ts` in sdk/typescript) and the release binding installed in --python's environment
(`maturin develop --release -m sdk/python/Cargo.toml`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

from bench_rounds import run_rounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def serve(binary: str, broker_mib: int) -> tuple[subprocess.Popen[bytes], str, str]:
    """A fresh server with `broker_mib` of log memory per broker (4 brokers, 8 MiB segments)."""
    data = tempfile.mkdtemp(prefix="sdk-bench-", dir="/dev/shm")
    segments = max(24, broker_mib // 8)
    config = os.path.join(data, "serve.toml")
    with open(config, "w") as f:
        # Prefaulted: unprefaulted, every client publishing into fresh region memory paid
        # the server's first-touch page faults, which halved the Rust publisher's figure
        # (docs/PERFORMANCE.md, "Session 25") and flattered the SDKs' share of it.
        f.write(f"[region]\nsegments_per_broker = {segments}\nprefault = true\n")
    cmd = [binary, "serve", "--config", config, "--data-dir", data]
    cmd += ["--base-port", "0", "--control-port", "0"]
    # It names its control address on stderr, then logs there: into a file, so that a
    # full pipe never stops it.
    log = os.path.join(data, "serve.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log) as f:
            for line in f:
                if "control API http://" in line:
                    return proc, line.split("control API http://")[1].split()[0], data
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log}")


def rust(binary: str, control: str, mode: str, mib: int) -> Dict[str, float]:
    """`embarcadero bench` (mode subscribe publishes, then times one subscriber reading it
    all), and the CPU its process used per GB of payload: for mode subscribe, the
    reader's alone (`subscribe_only_cpu_seconds`)."""
    cmd = [binary, "bench", "--control", control, "--mode", mode, "--order", "2", "--ack", "1"]
    cmd += ["--total-bytes", str(mib * MIB), "--no-ceilings", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    per_gb = cpu / (mib * MIB / 1e9)
    if mode == "publish":
        return {"rust publish": out["publish_mb_per_s"], "rust publish cpu s/GB": per_gb}
    mbs = out["payload_bytes"] / out["subscribe_only_seconds"] / 1e6
    reader_per_gb = out["subscribe_only_cpu_seconds"] / (out["payload_bytes"] / 1e9)
    return {"rust subscribe": mbs, "rust subscribe cpu s/GB": reader_per_gb}


def typescript(
    control: str, only: str, pub_mib: int, sub_mib: int, cwd: str = "", label: str = "ts"
) -> Dict[str, float]:
    """`bench.mjs` of the package in `cwd` (default: this repository's sdk/typescript)."""
    cmd = ["node", "bench.mjs", "--control", control, "--only", only, "--json"]
    cmd += ["--mb", str(pub_mib), "--sub-mb", str(sub_mib)]
    cwd = cwd or os.path.join(ROOT, "sdk", "typescript")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=cwd).stdout
    return {f"{label} {k}": v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def python(py: str, control: str, only: str, mib: int, label: str = "py") -> Dict[str, float]:
    cmd = [py, os.path.join(ROOT, "sdk", "python", "bench.py"), "--control", control]
    cmd += ["--only", only, "--total-bytes", str(mib * MIB)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return {f"{label} {k}": v for k, v in row.items()}


RATIOS = [
    ("ts publishMany", "rust publish"),
    ("py publish_many", "rust publish"),
    ("ts publish", "rust publish"),
    ("py publish", "rust publish"),
    ("ts subscribe", "rust subscribe"),
    ("ts pollMany", "rust subscribe"),
    ("ts pollBatch", "rust subscribe"),
    ("base ts publishMany", "rust publish"),
    ("base ts publish", "rust publish"),
    ("base ts subscribe", "rust subscribe"),
    ("base ts pollMany", "rust subscribe"),
    ("base ts pollBatch", "rust subscribe"),
    ("py subscribe (for m in sub)", "rust subscribe"),
    ("py subscribe (poll_many)", "rust subscribe"),
    ("py subscribe (poll_batch)", "rust subscribe"),
    ("base py subscribe (for m in sub)", "rust subscribe"),
    ("base py subscribe (poll_many)", "rust subscribe"),
    ("base py subscribe (poll_batch)", "rust subscribe"),
]


def one_round(args: argparse.Namespace, index: int) -> Dict[str, float]:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    control = ""  # the steps run once the server below is up
    steps: List[Callable[[], Dict[str, float]]] = [
        lambda: rust(args.bin, control, "publish", args.pub_mb),
        lambda: rust(args.bin, control, "subscribe", args.sub_mb),
    ]
    if not args.no_typescript:
        steps.append(lambda: typescript(control, "publishMany", args.pub_mb, args.sub_mb))
        steps.append(lambda: typescript(control, "publish", args.pub_mb, args.sub_mb))
        steps.append(lambda: typescript(control, "subscribe", args.pub_mb, args.sub_mb))
    if not args.no_python:
        steps.append(lambda: python(args.python, control, "publish_many", args.pub_mb))
        steps.append(lambda: python(args.python, control, "publish", args.pub_mb))
        steps.append(lambda: python(args.python, control, "subscribe", args.sub_mb))
    if args.python_base:
        base = args.python_base
        steps.append(lambda: python(base, control, "subscribe", args.sub_mb, "base py"))
    if args.ts_base:
        ts_base, mb = args.ts_base, (args.pub_mb, args.sub_mb)
        steps.append(lambda: typescript(control, "publishMany", *mb, ts_base, "base ts"))
        steps.append(lambda: typescript(control, "publish", *mb, ts_base, "base ts"))
        steps.append(lambda: typescript(control, "subscribe", *mb, ts_base, "base ts"))
    # A topic spreads over the 4 brokers; a round writes one per step, and every one must
    # fit: a memory-only topic's oldest batches are reclaimed once the region fills, even
    # after a first reader passed them, and a second reader from the start then waits for
    # messages that are gone (it happened with room for two).
    broker_mib = len(steps) * max(args.pub_mb, args.sub_mb) // 4 + 64
    proc, control, data = serve(args.bin, broker_mib)
    if index % 2 == 1:
        # Every other round the other way round, so that a drift of the machine's load
        # during a round favours neither side.
        steps.reverse()
    row: Dict[str, float] = {"round": index + 1}
    try:
        for step in steps:
            row.update(step())
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
    row["loadavg"] = float(load[0])
    row["loadavg_text"] = " ".join(load)  # type: ignore[assignment]
    for name, base in RATIOS:
        if name in row and base in row:
            row[f"{name} / {base}"] = row[name] / row[base]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=os.path.join(ROOT, "target/release/embarcadero"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pub-mb", type=int, default=1024, help="MiB per publish measurement")
    parser.add_argument("--sub-mb", type=int, default=1024, help="MiB per subscribe measurement")
    parser.add_argument("--out", help="append each round as a JSON line here")
    parser.add_argument("--no-python", action="store_true", help="Rust and TypeScript only")
    parser.add_argument("--no-typescript", action="store_true", help="Rust and Python only")
    parser.add_argument(
        "--python-base",
        metavar="PYTHON",
        help="also the Python subscriber of another build (an A/B): its figures are 'base py'",
    )
    parser.add_argument(
        "--ts-base",
        metavar="DIR",
        help="also the TypeScript client of another copy of sdk/typescript (built): 'base ts'",
    )
    args = parser.parse_args()
    rows = run_rounds(args.rounds, lambda i: one_round(args, i), args.out)
    for name, base in RATIOS:
        ratios = [r[f"{name} / {base}"] for r in rows if f"{name} / {base}" in r]
        if ratios:
            each = ", ".join(f"{x:.0%}" for x in ratios)
            print(f"{name} / {base}: median {statistics.median(ratios):.0%} ({each})")


if __name__ == "__main__":
    main()
