#!/usr/bin/env python3
"""Prints Markdown tables of the JSON results that scripts/peers/run.sh wrote, and
optionally draws them.

Usage: scripts/peers/summarize.py [DIR] [--plot FILE.png]   (default DIR: bench-results/peers)

Flat-out runs (run.sh without --rate): one row per (peer, variant): MB/s of each run, their
mean, mean msg/s, median of the runs' p50 and p99 acknowledgement latencies, and mean CPU
seconds (server + client) per GB. Below the table, each system's mean throughput as a
multiple of Kafka's (acks=1 and acks=all).

Fixed-rate runs (run.sh --rate): one latency table per offered rate, every peer and variant
side by side: achieved MB/s next to the offered rate (flagged when not sustained), the
median over the runs of p50, p99 and p99.9 (latency from each message's scheduled send
time), each run's p99, the sender's worst lateness against its schedule and the CPU used by
other work on the machine. Under each table: whether each Embarcadero variant's p99 is lower
than every peer's at that rate, computed from the table.

--plot draws mean MB/s per (peer, variant) and the p99 latencies side by side for the flat
runs, and p99 against offered load per system for the fixed-rate runs; it needs matplotlib
(`scripts/peers/install.sh plot`, then run this with $PEERS_DIR/venv/bin/python3).
"""
import glob
import json
import os
import statistics
import sys


def load(d):
    """(peer, variant) -> runs for flat-out results, and
    offered MB/s -> (peer, variant) -> runs for fixed-rate results."""
    flat, paced = {}, {}
    for f in sorted(glob.glob(os.path.join(d, "*.json"))):
        r = json.load(open(f))
        rate = r.get("offered_mb_per_s")
        rows = flat if rate is None else paced.setdefault(rate, {})
        rows.setdefault((r["peer"], r["variant"]), []).append(r)
    for rows in [flat, *paced.values()]:
        for rs in rows.values():
            rs.sort(key=lambda r: r["run"])
    return flat, dict(sorted(paced.items()))


def median_latency(rs, key):
    v = [(r["latency_ms"] or {})[key] for r in rs if key in (r["latency_ms"] or {})]
    return statistics.median(v) if v else None


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows):
    print("| peer | variant | runs (MB/s) | mean MB/s | mean msg/s | p50 ms | p99 ms | CPU s/GB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (peer, variant), rs in rows.items():
        mbs = [r["mb_per_s"] for r in rs]
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


def sustained(rs):
    """Whether every run kept up with the offered rate (run.sh's "sustained")."""
    return all(r.get("sustained", True) for r in rs)


def latency_tables(paced):
    for rate, rows in paced.items():
        size = next(iter(rows.values()))[0]["message_bytes"]
        print(f"\n### Offered {rate:g} MB/s ({size} B messages: {rate * 1e6 / size / 1e3:.1f} k msg/s)\n")
        print("| peer | variant | achieved MB/s (of offered) | p50 ms | p99 ms | p99.9 ms | p99 of each run (ms) "
              "| sender max lateness ms | other CPU s (max) | latency per |")
        print("|---|---|---:|---:|---:|---:|---|---:|---:|---|")
        for (peer, variant), rs in rows.items():
            achieved = statistics.mean(r["mb_per_s"] for r in rs)
            flag = "" if sustained(rs) else " **not sustained**"
            late = [r["schedule_max_lateness_ms"] for r in rs if r.get("schedule_max_lateness_ms") is not None]
            other = [r["other_cpu_s"] for r in rs if r.get("other_cpu_s") is not None]
            per = "batch" if "per batch" in (rs[0].get("latency_from") or "") else "message"
            print(f"| {peer} | {variant} | {achieved:.1f} ({100 * achieved / rate:.0f}%){flag} | "
                  f"{fmt(median_latency(rs, 'p50'), 2)} | {fmt(median_latency(rs, 'p99'), 2)} | "
                  f"{fmt(median_latency(rs, 'p99_9'), 2)} | "
                  f"{', '.join(fmt((r['latency_ms'] or {}).get('p99'), 2) for r in rs)} | "
                  f"{fmt(max(late) if late else None, 2)} | {fmt(max(other) if other else None, 2)} | {per} |")
        print()
        for line in verdicts(rows):
            print(f"- {line}")


def verdicts(rows):
    """For each Embarcadero variant: is its median p99 lower than every peer's?"""
    peers = {k: median_latency(rs, "p99") for k, rs in rows.items() if k[0] != "embarcadero"}
    peers = {k: v for k, v in peers.items() if v is not None}
    mine = {k: rs for k, rs in rows.items() if k[0] == "embarcadero"}
    if not mine:
        return ["no Embarcadero results at this rate"]
    if not peers:
        return ["no peer results at this rate to compare with"]
    lines = []
    for (_, variant), rs in mine.items():
        p99 = median_latency(rs, "p99")
        best_key = min(peers, key=peers.get)
        best = peers[best_key]
        not_beaten = [f"{p} {v} ({x:.2f} ms)" for (p, v), x in peers.items() if x <= p99]
        caveat = "" if sustained(rs) else " (but Embarcadero did not sustain the offered rate)"
        if not not_beaten:
            lines.append(f"Embarcadero {variant}: p99 {p99:.2f} ms is **lower than every peer's** "
                         f"(lowest peer: {best_key[0]} {best_key[1]} {best:.2f} ms, "
                         f"{best / p99:.1f}x){caveat}")
        else:
            lines.append(f"Embarcadero {variant}: p99 {p99:.2f} ms is **not** lower than every "
                         f"peer's; as low or lower: {', '.join(not_beaten)}{caveat}")
    return lines


def plot(flat, paced, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        sys.exit("--plot needs matplotlib: scripts/peers/install.sh plot, then run this script "
                 "with $PEERS_DIR/venv/bin/python3 (default ~/.cache/embarcadero-peers/venv)")
    panels = (2 if flat else 0) + (1 if paced else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    axes = list(axes[0])
    if flat:
        a, b = axes.pop(0), axes.pop(0)
        labels = [f"{p}\n{v}" for p, v in flat]
        mbs = [statistics.mean(r["mb_per_s"] for r in rs) for rs in flat.values()]
        p99 = [median_latency(rs, "p99") or 0 for rs in flat.values()]
        colors = ["#c0392b" if p == "embarcadero" else "#7f8c8d" for p, _ in flat]
        a.bar(labels, mbs, color=colors)
        a.set_ylabel("MB/s (1 KiB messages, one ordered log)")
        a.set_title("Publish throughput (mean of runs)")
        b.bar(labels, p99, color=colors)
        b.set_yscale("log")
        b.set_ylabel("p99 acknowledgement latency, ms (log scale)")
        b.set_title("p99 latency at saturation")
        for ax in (a, b):
            ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    if paced:
        c = axes.pop(0)
        systems = sorted({k for rows in paced.values() for k in rows})
        for peer, variant in systems:
            xs, ys, bad = [], [], []
            for rate, rows in paced.items():
                rs = rows.get((peer, variant))
                v = median_latency(rs, "p99") if rs else None
                if v is None:
                    continue
                xs.append(rate)
                ys.append(v)
                if not sustained(rs):
                    bad.append((rate, v))
            # One colour per system; a line style per durability: memory or page cache
            # (solid), every write forced to disk before the ack (dotted), the rest (dashed).
            color = {"embarcadero": "#c0392b", "kafka": "#2471a3", "nats": "#229954",
                     "redis": "#7d3c98"}.get(peer, "#7f8c8d")
            if variant in ("ack1", "acks1", "file", "noaof"):
                marker, ls = "o", "-"
            elif variant in ("ack2", "acksall-fsync", "file-sync", "aof-always"):
                marker, ls = "^", ":"
            else:
                marker, ls = "s", "--"
            c.plot(xs, ys, marker=marker, ls=ls, color=color,
                   lw=2.2 if peer == "embarcadero" else 1.2, label=f"{peer} {variant}")
            if bad:
                c.scatter(*zip(*bad), marker="x", s=90, color="black", zorder=5)
        c.set_xscale("log")
        c.set_yscale("log")
        c.set_xticks(list(paced))
        c.set_xticklabels([f"{r:g}" for r in paced])
        c.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        c.set_xlabel("offered load, MB/s (x: not sustained)")
        c.set_ylabel("p99 latency from scheduled send, ms (log)")
        c.set_title("p99 at the same offered load (median of runs)")
        c.legend(fontsize=7)
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
    flat, paced = load(d)
    if not flat and not paced:
        sys.exit(f"no results in {d}")
    if flat:
        table(flat)
    if paced:
        print("\n## Latency at the same offered load (run.sh --rate)")
        latency_tables(paced)
    if out:
        plot(flat, paced, out)


if __name__ == "__main__":
    main()
