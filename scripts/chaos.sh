#!/usr/bin/env bash
# Fault campaign (issue 28): `embarcadero chaos` for CHAOS_SECS seconds (default 600) or
# CHAOS_CYCLES cycles. Each cycle starts a cluster of real processes (head, two follower
# brokers, an active and a standby sequencer), publishes with two publishers and reads
# with two readers while one fault strikes and heals (SIGKILL/SIGSTOP of a follower, of
# the active sequencer, SIGSTOP of the head, SIGKILL of the head and its restart, deletion
# of the region file, a full replica disk, a slow replica disk, a follower cut off from
# everyone, and a pair of sides (head, a follower, the clients) cut off from each other
# only: the brokers then run in network namespaces, which need root; the partitions are
# left out, saying why, where those cannot be made), writes every send, acknowledgement and delivery to a
# history file and checks it: lost acknowledged messages, duplicates, real-time
# reordering, readers that disagree, order-5 session FIFO breaks, positions that go
# back, repeat or skip. Stops at
# the first anomaly and keeps its history in $OUT (default bench-results/chaos-histories).
# Extra arguments go to `embarcadero chaos` (e.g. --nemesis pause-head --seed 7).
# Needs `cargo build --release -p embarcadero-cli` first.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${EMBARCADERO_BIN:-target/release/embarcadero}
OUT=${OUT:-bench-results/chaos-histories}
[ -x "$B" ] || { echo "build first: cargo build --release -p embarcadero-cli" >&2; exit 1; }
limit=(--seconds "${CHAOS_SECS:-600}")
if [ -n "${CHAOS_CYCLES:-}" ]; then
  limit=(--cycles "$CHAOS_CYCLES")
fi
exec "$B" chaos "${limit[@]}" --out "$OUT" "$@"
