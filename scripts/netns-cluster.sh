#!/usr/bin/env bash
# A cluster across network "hosts": the head, two follower brokers, the sequencer and a
# client each in a Linux network namespace of their own, with an address of their own,
# joined by veth pairs to a bridge that lives in a namespace of its own too (so no
# traffic touches the machine's own interfaces). All processes attach to one region
# file, as hosts attached to one CXL pool would.
#
# It publishes through every broker, reads everything back in order from the client
# namespace, SIGKILLs one follower, publishes again (the publisher fails over), and
# checks every message once. It removes everything it made, also on failure.
#
# Needs root (or CAP_NET_ADMIN) and iproute2. Usage:
#   cargo build --release -p embarcadero-cli && sudo scripts/netns-cluster.sh
set -euo pipefail

BIN=${EMBARCADERO_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release/embarcadero}
PREFIX=${NETNS_PREFIX:-emb$$}
SUBNET=${NETNS_SUBNET:-10.213.77}
WORK=$(mktemp -d)
REGION=/dev/shm/$PREFIX.region
HUB=$PREFIX-hub
HOSTS=(head b1 b2 seq client)
declare -A ADDR=([head]=$SUBNET.1 [b1]=$SUBNET.2 [b2]=$SUBNET.3 [seq]=$SUBNET.4 [client]=$SUBNET.10)
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for h in "${HOSTS[@]}"; do ip netns del "$PREFIX-$h" 2>/dev/null || true; done
  ip netns del "$HUB" 2>/dev/null || true
  rm -rf "$WORK" "$REGION"
}
trap cleanup EXIT

[ -x "$BIN" ] || { echo "build first: cargo build --release -p embarcadero-cli" >&2; exit 1; }
in_ns() { local h=$1; shift; ip netns exec "$PREFIX-$h" "$@"; }

# The wiring: one bridge in the hub namespace, one veth pair per host.
ip netns add "$HUB"
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
for h in "${HOSTS[@]}"; do
  ns=$PREFIX-$h
  ip netns add "$ns"
  ip link add "$PREFIX$h" type veth peer name eth0 netns "$ns"
  ip link set "$PREFIX$h" netns "$HUB"
  ip -n "$HUB" link set "$PREFIX$h" master br0 up
  ip -n "$ns" addr add "${ADDR[$h]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

# Starts a process in a namespace and waits for a line in its log.
start() {
  local host=$1 ready=$2; shift 2
  local log=$WORK/$host.log
  # `ip netns exec` execs the program: $! is the embarcadero process itself.
  ip netns exec "$PREFIX-$host" "$@" >"$log" 2>&1 &
  PIDS+=($!)
  disown "$!"
  for _ in $(seq 300); do
    grep -q "$ready" "$log" && return 0
    kill -0 "${PIDS[-1]}" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  echo "$host never printed: $ready" >&2; cat "$log" >&2; exit 1
}

HEAD=${ADDR[head]}:12140
export EMBARCADERO_REGION_PATH=$REGION
start head "embarcadero is serving" "$BIN" broker --head --brokers 3 --external-sequencer \
  --bind "${ADDR[head]}" --base-port 1214 --control-port 12140 --data-dir "$WORK/head"
start b1 "is serving at" "$BIN" broker --follower --head-addr "$HEAD" --broker-id 1 \
  --bind "${ADDR[b1]}" --port 1215
start b2 "is serving at" "$BIN" broker --follower --head-addr "$HEAD" --broker-id 2 \
  --bind "${ADDR[b2]}" --port 1216
B2_PID=${PIDS[-1]}
start seq "sequencer is active" "$BIN" sequencer --head-addr "$HEAD"

client() { in_ns client "$BIN" "$@" --control "$HEAD"; }
client status
client topic create t --order 2

# 30000 messages through all three brokers, read back in order from the client host.
seq 0 29999 | client pub t --batch-bytes 4096 >/dev/null
client sub t --count 30000 --idle-timeout-s 30 >"$WORK/first.txt"
seq 0 29999 | sort >"$WORK/expected.txt"
sort "$WORK/first.txt" | diff -q - "$WORK/expected.txt" >/dev/null \
  || { echo "FAIL: first 30000 messages not delivered exactly once" >&2; exit 1; }

# One broker host dies; the next publisher uses the live ones.
kill -9 "$B2_PID"
for _ in $(seq 100); do
  client status | grep -qE "^2 .* dead" && break
  sleep 0.1
done
client status | grep -E "^2 .* dead" || { echo "FAIL: broker 2 not declared dead" >&2; exit 1; }
seq 30000 39999 | client pub t --batch-bytes 4096 >/dev/null
client sub t --count 40000 --idle-timeout-s 30 >"$WORK/all.txt"
seq 0 39999 | sort >"$WORK/expected.txt"
sort "$WORK/all.txt" | diff -q - "$WORK/expected.txt" >/dev/null \
  || { echo "FAIL: messages lost or duplicated after the broker died" >&2; exit 1; }
head -n 30000 "$WORK/all.txt" | diff -q - "$WORK/first.txt" >/dev/null \
  || { echo "FAIL: the order changed" >&2; exit 1; }
client status
echo "PASS: 3 broker hosts, a sequencer host and a client host on $SUBNET.0/24; 40000 messages once, in one order, across a broker death"
