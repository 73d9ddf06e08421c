#!/usr/bin/env python3
"""Prints a Markdown table of the JSON results that scripts/peers/run.sh wrote.

Usage: scripts/peers/summarize.py [DIR]   (default bench-results/peers)

One row per (peer, variant): MB/s of each run, their mean, mean msg/s, median of the runs'
p50 and p99 acknowledgement latencies, and mean CPU seconds (server + client) per GB.
"""
import glob
import json
import os
import statistics
import sys


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "bench-results/peers"
    rows = {}
    for f in sorted(glob.glob(os.path.join(d, "*.json"))):
        r = json.load(open(f))
        rows.setdefault((r["peer"], r["variant"]), []).append(r)
    if not rows:
        sys.exit(f"no results in {d}")
    print("| peer | variant | runs (MB/s) | mean MB/s | mean msg/s | p50 ms | p99 ms | CPU s/GB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (peer, variant), rs in rows.items():
        rs.sort(key=lambda r: r["run"])
        mbs = [r["mb_per_s"] for r in rs]
        lat = [r["latency_ms"] or {} for r in rs]

        def med(key):
            v = [x[key] for x in lat if key in x]
            return f"{statistics.median(v):.1f}" if v else "-"

        cpu = [r["cpu_s_per_gb"] for r in rs if r.get("cpu_s_per_gb") is not None]
        print(f"| {peer} | {variant} | {', '.join(f'{m:.0f}' for m in mbs)} | "
              f"**{statistics.mean(mbs):.0f}** | {statistics.mean(r['msgs_per_s'] for r in rs) / 1e3:.0f} k | "
              f"{med('p50')} | {med('p99')} | {statistics.mean(cpu):.1f} |")


if __name__ == "__main__":
    main()
