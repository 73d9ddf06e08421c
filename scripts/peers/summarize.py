#!/usr/bin/env python3
"""Prints a Markdown table of the JSON results that scripts/peers/run.sh wrote, and
optionally draws them.

Usage: scripts/peers/summarize.py [DIR] [--plot FILE.png]   (default DIR: bench-results/peers)

One row per (peer, variant): MB/s of each run, their mean, mean msg/s, median of the runs'
p50 and p99 acknowledgement latencies, and mean CPU seconds (server + client) per GB. Below
the table, each system's mean throughput as a multiple of Kafka's (acks=1 and acks=all).
--plot draws mean MB/s per (peer, variant) and the p99 latencies side by side; it needs
matplotlib (`scripts/peers/install.sh plot`, then run this with $PEERS_DIR/venv/bin/python3).
"""
import glob
import json
import os
import statistics
import sys


def load(d):
    rows = {}
    for f in sorted(glob.glob(os.path.join(d, "*.json"))):
        r = json.load(open(f))
        rows.setdefault((r["peer"], r["variant"]), []).append(r)
    for rs in rows.values():
        rs.sort(key=lambda r: r["run"])
    return rows


def median_latency(rs, key):
    v = [(r["latency_ms"] or {})[key] for r in rs if key in (r["latency_ms"] or {})]
    return statistics.median(v) if v else None


def table(rows):
    print("| peer | variant | runs (MB/s) | mean MB/s | mean msg/s | p50 ms | p99 ms | CPU s/GB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (peer, variant), rs in rows.items():
        mbs = [r["mb_per_s"] for r in rs]
        fmt = lambda v: "-" if v is None else f"{v:.1f}"
        cpu = [r["cpu_s_per_gb"] for r in rs if r.get("cpu_s_per_gb") is not None]
        print(f"| {peer} | {variant} | {', '.join(f'{m:.0f}' for m in mbs)} | "
              f"**{statistics.mean(mbs):.0f}** | {statistics.mean(r['msgs_per_s'] for r in rs) / 1e3:.0f} k | "
              f"{fmt(median_latency(rs, 'p50'))} | {fmt(median_latency(rs, 'p99'))} | "
              f"{statistics.mean(cpu):.1f} |")
    means = {k: statistics.mean(r["mb_per_s"] for r in rs) for k, rs in rows.items()}
    for base in (("kafka", "acks1"), ("kafka", "acksall")):
        if base not in means:
            continue
        print(f"\nAs a multiple of Kafka {base[1]} ({means[base]:.0f} MB/s): " + ", ".join(
            f"{p} {v} {m / means[base]:.1f}x" for (p, v), m in means.items() if (p, v) != base))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: scripts/peers/install.sh plot, then run this script "
                 "with $PEERS_DIR/venv/bin/python3 (default ~/.cache/embarcadero-peers/venv)")
    labels = [f"{p}\n{v}" for p, v in rows]
    mbs = [statistics.mean(r["mb_per_s"] for r in rs) for rs in rows.values()]
    p99 = [median_latency(rs, "p99") or 0 for rs in rows.values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = ["#c0392b" if p == "embarcadero" else "#7f8c8d" for p, _ in rows]
    a.bar(labels, mbs, color=colors)
    a.set_ylabel("MB/s (1 KiB messages, one ordered log)")
    a.set_title("Publish throughput (mean of runs)")
    b.bar(labels, p99, color=colors)
    b.set_yscale("log")
    b.set_ylabel("p99 acknowledgement latency, ms (log scale)")
    b.set_title("p99 latency at saturation")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def main():
    args = sys.argv[1:]
    out = None
    if "--plot" in args:
        i = args.index("--plot")
        out = args[i + 1]
        del args[i:i + 2]
    d = args[0] if args else "bench-results/peers"
    rows = load(d)
    if not rows:
        sys.exit(f"no results in {d}")
    table(rows)
    if out:
        plot(rows, out)


if __name__ == "__main__":
    main()
