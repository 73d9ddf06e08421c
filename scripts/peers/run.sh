#!/usr/bin/env bash
# Benchmarks the peer systems installed by scripts/peers/install.sh with the workload of
# `embarcadero bench --order 2 --ack 1`: one totally ordered log (1 partition / 1 stream),
# one publisher, 1 KiB messages, a given total of payload bytes. Every run starts its server
# fresh on 127.0.0.1 with an empty data directory, publishes, records one JSON file, and
# stops the server. Settings and their reasons: docs/BENCHMARKS.md.
#
# Usage: scripts/peers/run.sh [--quick] [--peers embarcadero,kafka,nats,redis] [--variants V1,V2]
#                             [--runs N] [--total-bytes BYTES] [--rate R[,R2,...]] [--warmup S]
#                             [--out DIR]
# Variants: embarcadero ack1,ack2; kafka acks1,acksall,acksall-fsync; nats file,memory,file-sync;
# redis noaof,aof-everysec,aof-always. The -fsync/-sync/-always variants force every write to
# disk before the acknowledgement, as Embarcadero's ack 2 does (its replica's fdatasync), and
# keep their data under DISK_ROOT like Embarcadero's replica.
# Embarcadero runs `target/release/embarcadero bench` (build it first; EMBARCADERO_BIN overrides)
# in the same series, so every figure of one run of this script comes from the same minutes.
# Without --rate every client publishes as fast as its window allows (<peer>-<variant>-run<N>.json).
# With --rate each run offers R MB/s on a schedule fixed in advance, latency from each message's
# due time (<peer>-<variant>-rate<R>-run<N>.json); Kafka then uses kafkabench, not
# ProducerPerformance. Every client first publishes S seconds (default 5) at the same rate as a
# warm-up, waits for their acks and leaves them out of the figures; the total excludes them.
# Each publish is bounded by max(RUN_TIMEOUT, 2 x (total + warm-up) / rate + 60 s).
# Environment: PEERS_DIR (as for install.sh), DATA_ROOT (where servers keep their data;
# default /dev/shm, like `embarcadero bench`'s region, else /tmp), DISK_ROOT (a directory on
# a disk for the variants that fsync and Embarcadero's ack-2 replica; default $REPLICA_ROOT,
# else /var/tmp: never tmpfs, where fsync costs nothing), KAFKA_PORT (19092, and
# +1 for the controller), NATS_PORT (14222), REDIS_PORT (16379), RUN_TIMEOUT (seconds one
# publish may take, default 300), KAFKA_BATCH / KAFKA_LINGER_MS / KAFKA_BUFFER /
# KAFKA_EXTRA_PROPS (producer settings, defaults 524288 / 1 / 67108864 / none),
# EMBARCADERO_LINGER_US (bench --linger-us, default 1000 like Kafka's linger.ms=1),
# EMBARCADERO_EPOCH_US (bench --epoch-us, the sequencer's epoch, default 500).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/embarcadero-peers}
KAFKA_VERSION=${KAFKA_VERSION:-4.1.0}
KAFKA_PORT=${KAFKA_PORT:-19092}
NATS_PORT=${NATS_PORT:-14222}
REDIS_PORT=${REDIS_PORT:-16379}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
# Kafka producer knobs (docs/BENCHMARKS.md says why these defaults).
KAFKA_BATCH=${KAFKA_BATCH:-524288}
KAFKA_LINGER_MS=${KAFKA_LINGER_MS:-1}
KAFKA_BUFFER=${KAFKA_BUFFER:-67108864}
KAFKA_EXTRA_PROPS=${KAFKA_EXTRA_PROPS:-}
EMBARCADERO_LINGER_US=${EMBARCADERO_LINGER_US:-1000}
EMBARCADERO_EPOCH_US=${EMBARCADERO_EPOCH_US:-500}
DISK_ROOT=${DISK_ROOT:-${REPLICA_ROOT:-/var/tmp}}
if [[ -z ${DATA_ROOT:-} ]]; then
  if [[ -d /dev/shm && -w /dev/shm ]]; then DATA_ROOT=/dev/shm; else DATA_ROOT=/tmp; fi
fi

PEERS=embarcadero,kafka,nats,redis
EMBARCADERO_BIN=${EMBARCADERO_BIN:-$ROOT/target/release/embarcadero}
RUNS=2
TOTAL=1000000000
OUT=$ROOT/bench-results/peers
SIZE=1024
QUICK=0
ONLY_VARIANTS=
RATES=
WARMUP_S=5
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) RATES=$2; shift 2 ;;
    --warmup) WARMUP_S=$2; shift 2 ;;
    --quick) QUICK=1; RUNS=1; TOTAL=50000000; shift ;;
    --peers) PEERS=$2; shift 2 ;;
    --variants) ONLY_VARIANTS=",$2,"; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --total-bytes) TOTAL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
COUNT=$((TOTAL / SIZE))
# The offered rate of the current run in MB/s (10^6 B/s of payload); empty: flat out.
# WARMUP: the messages of its warm-up (WARMUP_S seconds at RATE; 0 when flat out).
RATE=
WARMUP=0
if [[ -n $RATES ]]; then
  IFS=, read -r -a rate_list <<<"$RATES"
  [[ $WARMUP_S =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "--warmup takes seconds: $WARMUP_S" >&2; exit 2; }
  for r in "${rate_list[@]}"; do
    [[ $r =~ ^[0-9]+([.][0-9]+)?$ ]] && [[ $r != 0 ]] || { echo "--rate takes MB/s > 0, comma-separated: $r" >&2; exit 2; }
  done
else
  rate_list=("")
fi

log() { printf '[peers] %s\n' "$*" >&2; }

# --- process and temp-dir bookkeeping: everything started here is stopped on exit ---------
SERVER_PID=
WORK=
REPLICA=
stop_server() {
  if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
cleanup() {
  stop_server
  if [[ -n $WORK && -d $WORK ]]; then rm -rf "$WORK"; fi
  if [[ -n $REPLICA && -d $REPLICA ]]; then rm -rf "$REPLICA"; fi
  WORK= REPLICA=
}
trap cleanup EXIT
trap 'exit 130' INT TERM

new_workdir() { # [disk]: under DISK_ROOT instead of DATA_ROOT
  cleanup
  WORK=$(mktemp -d "$([[ ${1:-} == disk ]] && echo "$DISK_ROOT" || echo "$DATA_ROOT")/peerbench.XXXXXX")
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port seconds
  local i
  for i in $(seq 1 $(($2 * 10))); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
need_free() {
  local p
  for p in "$@"; do port_free "$p" || { log "port $p is in use; set another"; exit 1; }; done
}

# CPU seconds (user + system) used so far by a process, its threads and its reaped children
# (e.g. Redis's AOF-rewrite fork).
proc_cpu() {
  [[ -n $1 ]] || { echo 0; return; }  # no separate server process (embarcadero bench)
  awk -v t="$(getconf CLK_TCK)" '{print ($14 + $15 + $16 + $17) / t}' "/proc/$1/stat" 2>/dev/null || echo 0
}

# CPU seconds the whole machine has been busy (all cores): time since boot x cores, less the
# idle and iowait time of /proc/stat. The kernel measures idle time exactly (tickless), whereas
# its user/system fields are sampled at timer ticks and miss clients that wake for a few
# microseconds thousands of times a second (the fixed-rate runs): summing those made
# other_cpu_s read up to -2 s there.
machine_busy() {
  awk -v t="$(getconf CLK_TCK)" 'NR == FNR {up = $1; next}
    /^cpu[0-9]/ {n++} /^cpu / {idle = ($5 + $6) / t}
    END {printf "%.3f\n", up * n - idle}' /proc/uptime /proc/stat
}

# Seconds one publish may take: RUN_TIMEOUT, or more when the offered rate makes the run long.
publish_timeout() {
  if [[ -z $RATE ]]; then echo "$RUN_TIMEOUT"; return; fi
  python3 -c 'import sys; t, b, r = map(float, sys.argv[1:]); print(int(max(t, 2 * b / (r * 1e6) + 60)))' \
    "$RUN_TIMEOUT" "$((TOTAL + WARMUP * SIZE))" "$RATE"
}

# Sets WARMUP for the offered rate RATE: WARMUP_S seconds of messages.
set_warmup() {
  WARMUP=0
  [[ -n $RATE ]] || return 0
  WARMUP=$(python3 -c 'import sys; s, r, z = map(float, sys.argv[1:]); print(int(s * r * 1e6 / z))' \
           "$WARMUP_S" "$RATE" "$SIZE")
}

# Runs the client command, timed, with its stdout to $WORK/client.out and stderr to
# $WORK/client.err; sets CLIENT_CPU, WALL and SERVER_CPU (server CPU during the client run).
run_client() {
  local s0 t0 m0 rc=0
  s0=$(proc_cpu "$SERVER_PID")
  m0=$(machine_busy)
  t0=$(date +%s.%N)
  /usr/bin/time -f '%U %S' -o "$WORK/client.time" \
    timeout --kill-after=10 "$(publish_timeout)" "$@" >"$WORK/client.out" 2>"$WORK/client.err" || rc=$?
  WALL=$(echo "$(date +%s.%N) - $t0" | bc)
  SERVER_CPU=$(echo "$(proc_cpu "$SERVER_PID") - $s0" | bc)
  CLIENT_CPU=$(awk 'END {print $1 + $2}' "$WORK/client.time")
  # CPU used during the run by anything but this server and client: other load on the machine.
  OTHER_CPU=$(echo "$(machine_busy) - $m0 - $SERVER_CPU - $CLIENT_CPU" | bc)
  if [[ $rc != 0 ]]; then
    log "client exited $rc"; tail -20 "$WORK/client.err" >&2; tail -5 "$WORK/client.out" >&2
    return $rc
  fi
}

# Writes one result JSON from the client's summary (a JSON object with messages, bytes,
# seconds, mb_per_s, msgs_per_s and latency_ms, and at a fixed rate latency_from and
# schedule_max_lateness_ms; other keys go to "details").
# At a fixed rate, mb_per_s is the achieved rate (payload from the start of the schedule to
# the last acknowledgement) and offered_mb_per_s the offered one; "sustained" is false when
# the achieved rate fell more than 5% short or the sender ended up more than a second
# behind its schedule.
# args: peer variant run durability settings-json summary-json command...
# OTHER_CPU > ~5% of the run's wall time x 2 cores means something else shared the machine.
write_result() {
  local peer=$1 variant=$2 run=$3 durability=$4 settings=$5 summary=$6
  shift 6
  local f="$OUT/$peer-$variant${RATE:+-rate$RATE}-run$run.json"
  python3 - "$f" "$peer" "$variant" "$run" "$durability" "$settings" "$summary" \
      "$SIZE" "$SERVER_CPU" "$CLIENT_CPU" "$OTHER_CPU" "$WALL" "$(dirname "$WORK")" "$QUICK" "$RATE" "$*" <<'PY'
import json, sys, platform, datetime
(f, peer, variant, run, durability, settings, summary, size, scpu, ccpu, ocpu, wall,
 data_root, quick, rate, command) = sys.argv[1:]
s = json.loads(summary)
lat = s.pop("latency_ms", None)
keys = ("messages", "bytes", "seconds", "mb_per_s", "msgs_per_s")
main = {k: s.pop(k) for k in keys}
warmup = s.pop("warmup_messages", 0) or 0
# CPU is measured over the whole client run, warm-up included: per GB of all it published.
gb = (main["bytes"] + warmup * int(size)) / 1e9
scpu, ccpu = float(scpu), float(ccpu)
offered = float(rate) if rate else None
s.pop("offered_mb_per_s", None)
latency_from = s.pop("latency_from", None)
late = s.pop("schedule_max_lateness_ms", None)
paced = {}
if offered:
    paced = {
        "warmup_messages": warmup,
        "schedule_max_lateness_ms": late,
        "sustained": main["mb_per_s"] >= 0.95 * offered and (late is None or late < 1000),
    }
out = {
    "peer": peer, "variant": variant, "run": int(run), "message_bytes": int(size),
    "offered_mb_per_s": offered,
    **main,
    "latency_ms": lat,
    "latency_from": latency_from,
    **paced,
    "durability": durability,
    "command": command,
    "settings": json.loads(settings),
    "server_cpu_s": round(scpu, 3), "client_cpu_s": round(ccpu, 3),
    "cpu_s_per_gb": round((scpu + ccpu) / gb, 3) if gb else None,
    "client_wall_s": round(float(wall), 3),
    "other_cpu_s": round(float(ocpu), 3),
    "load1_after": float(open("/proc/loadavg").read().split()[0]),
    "data_root": data_root, "quick": quick == "1",
    "details": s,
    "host": platform.node(), "utc": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
}
json.dump(out, open(f, "w"), indent=2)
l = lat or {}
ms = lambda v: "-" if v is None else f"{v:.3f}"
offer = "" if not offered else (f"offered {offered:g} MB/s, achieved" +
                                ("" if out["sustained"] else " (NOT SUSTAINED)"))
print(f"{peer:11} {variant:13} run {run}: {offer} {out['mb_per_s']:8.1f} MB/s {out['msgs_per_s']:10.0f} msg/s"
      f"  p50 {ms(l.get('p50'))} ms  p99 {ms(l.get('p99'))} ms  p99.9 {ms(l.get('p99_9'))} ms"
      f"  cpu {out['cpu_s_per_gb']} s/GB  other {out['other_cpu_s']} s  -> {f}")
PY
}

# --- Kafka ------------------------------------------------------------------------------
KAFKA_LIBS="$PEERS_DIR/kafka-$KAFKA_VERSION/libs"
# The fixed-rate load generator (scripts/peers/kafkabench, built by install.sh kafka).
KAFKABENCH_JAR="$PEERS_DIR/kafka-$KAFKA_VERSION/kafkabench.jar"
KAFKA_JVM_GC=(-XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
              -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true)
kjava() { java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$KAFKA_LIBS/*" "$@"; }

kafka_start() { # [extra server.properties line]
  need_free "$KAFKA_PORT" $((KAFKA_PORT + 1))
  local cfg="$WORK/server.properties"
  cat >"$cfg" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$((KAFKA_PORT + 1))
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$((KAFKA_PORT + 1))
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$WORK/kafka-logs
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
message.max.bytes=2097152
${1:-}
EOF
  kjava kafka.tools.StorageTool format -t "$(kjava kafka.tools.StorageTool random-uuid)" \
    -c "$cfg" >"$WORK/format.log" 2>&1 || { cat "$WORK/format.log" >&2; return 1; }
  java -Xms2g -Xmx2g "${KAFKA_JVM_GC[@]}" -Dorg.slf4j.simpleLogger.defaultLogLevel=info \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$cfg" >"$WORK/kafka.log" 2>&1 &
  SERVER_PID=$!
  wait_port "$KAFKA_PORT" 90 || { log "kafka did not start"; tail -30 "$WORK/kafka.log" >&2; return 1; }
  kjava org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$KAFKA_PORT" --create \
    --topic bench --partitions 1 --replication-factor 1 >"$WORK/topic.log" 2>&1 \
    || { cat "$WORK/topic.log" >&2; return 1; }
}

kafka_run() { # variant run
  local variant=$1 run=$2 acks durability flush=
  case $variant in
    acks1) acks=1
      durability="acks=1: the partition leader appended the batch to its log segment (OS page cache; no fsync, Kafka's default log.flush.interval.messages is unbounded); replication factor 1" ;;
    acksall) acks=all
      durability="acks=all with replication factor 1 (the only in-sync replica is the leader): appended to the leader's log in the page cache, no fsync; idempotent producer on (the default with acks=all)" ;;
    acksall-fsync) acks=all flush=log.flush.interval.messages=1
      durability="acks=all, and the broker fsyncs the partition's log after every append (log.flush.interval.messages=1), before the response; log on DISK_ROOT" ;;
  esac
  new_workdir ${flush:+disk}
  kafka_start "$flush" || return 1
  local props=(bootstrap.servers=127.0.0.1:$KAFKA_PORT acks=$acks batch.size=$KAFKA_BATCH
               linger.ms=$KAFKA_LINGER_MS compression.type=none buffer.memory=$KAFKA_BUFFER
               max.request.size=$((KAFKA_BATCH > 1048576 ? KAFKA_BATCH : 1048576)) client.id=peerbench
               $KAFKA_EXTRA_PROPS)
  # Flat out: Kafka's own ProducerPerformance. At a fixed rate: kafkabench, which keeps a
  # schedule and measures from it (ProducerPerformance --throughput measures from send()).
  # Same JVM settings and the same producer settings either way.
  local cmd tool
  if [[ -n $RATE ]]; then
    tool=kafkabench
    cmd=(java -Xms1g -Xmx1g "${KAFKA_JVM_GC[@]}" -Dorg.slf4j.simpleLogger.defaultLogLevel=warn
         -cp "$KAFKABENCH_JAR:$KAFKA_LIBS/*" embarcadero.peers.KafkaBench --topic bench
         --size "$SIZE" --total-bytes "$TOTAL" --rate "$RATE" --warmup-records "$WARMUP"
         --timeout-s "$(publish_timeout)" --producer-props "${props[@]}")
  else
    tool=ProducerPerformance
    cmd=(java -Xms1g -Xmx1g "${KAFKA_JVM_GC[@]}" -Dorg.slf4j.simpleLogger.defaultLogLevel=warn
         -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.ProducerPerformance --topic bench
         --num-records "$COUNT" --record-size "$SIZE" --throughput -1
         --producer-props "${props[@]}")
  fi
  log "kafka $variant${RATE:+ at $RATE MB/s} run $run: $COUNT x $SIZE B ($tool)"
  run_client "${cmd[@]}" || return 1
  local summary
  if [[ -n $RATE ]]; then
    summary=$(tail -1 "$WORK/client.out") || return 1
  else
  # Final line: "N records sent, R records/sec (M MB/sec), A ms avg latency, X ms max latency,
  # P50 ms 50th, P95 ms 95th, P99 ms 99th, P999 ms 99.9th."
  summary=$(python3 - "$WORK/client.out" "$SIZE" <<'PY'
import json, re, sys
lines = [l for l in open(sys.argv[1]) if "records sent" in l]
m = re.search(r"(\d+) records sent, ([\d.]+) records/sec .*?([\d.]+) ms avg latency, ([\d.]+) ms max latency"
              r"(?:, (\d+) ms 50th, (\d+) ms 95th, (\d+) ms 99th, (\d+) ms 99.9th)?", lines[-1])
n, rate = int(m.group(1)), float(m.group(2))
size = int(sys.argv[2])
lat = {"mean": float(m.group(3)), "max": float(m.group(4))}
if m.group(5):
    lat.update(p50=float(m.group(5)), p95=float(m.group(6)), p99=float(m.group(7)), p99_9=float(m.group(8)))
print(json.dumps({"messages": n, "bytes": n * size, "seconds": n / rate, "mb_per_s": rate * size / 1e6,
                  "msgs_per_s": rate, "latency_ms": lat, "latency_from": "send() call",
                  "tool_summary": lines[-1].strip()}))
PY
) || return 1
  fi
  # The log holds what was acknowledged: check the partition's end offset.
  local end
  end=$(kjava org.apache.kafka.tools.GetOffsetShell --bootstrap-server "127.0.0.1:$KAFKA_PORT" \
        --topic bench --time -1 2>/dev/null | awk -F: '{print $3}')
  summary=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["log_end_offset"]=int(sys.argv[2] or -1); print(json.dumps(d))' "$summary" "$end")
  local settings
  settings=$(printf '{"kafka_version":"%s","load_generator":"%s","acks":"%s","batch_size":%s,"linger_ms":%s,"compression":"none","buffer_memory":%s,"extra_props":"%s","broker_extra":"%s","partitions":1,"replication_factor":1,"broker_heap":"2g","producer_heap":"1g","log_dirs":"%s"}' \
             "$KAFKA_VERSION" "$tool" "$acks" "$KAFKA_BATCH" "$KAFKA_LINGER_MS" "$KAFKA_BUFFER" "$KAFKA_EXTRA_PROPS" "$flush" "$(dirname "$WORK")")
  write_result kafka "$variant" "$run" "$durability" "$settings" "$summary" "${cmd[*]}" || return 1
  [[ $end == "$((COUNT + WARMUP))" ]] || { log "kafka: log end offset $end, expected $((COUNT + WARMUP))"; return 1; }
  stop_server
}

# --- NATS JetStream ---------------------------------------------------------------------
nats_run() { # variant run
  local variant=$1 run=$2 durability storage=$1 sync=
  case $variant in
    file) durability="JetStream PubAck from a file-backed stream, 1 replica: the message is in the stream's file store (written to the OS page cache; the server fsyncs every sync_interval, default 2 minutes, not per message)" ;;
    memory) durability="JetStream PubAck from a memory-backed stream, 1 replica: the message is in the server's memory only" ;;
    file-sync) storage=file sync=always
      durability="JetStream PubAck from a file-backed stream, 1 replica, with sync_interval: always: the server fsyncs every write before the PubAck; store on DISK_ROOT" ;;
  esac
  need_free "$NATS_PORT"
  new_workdir ${sync:+disk}
  # A config file only for what has no flag: jetstream's sync_interval.
  printf 'jetstream {\n  store_dir: "%s"\n%s}\n' "$WORK/jetstream" "${sync:+  sync_interval: $sync
}" >"$WORK/nats.conf"
  "$PEERS_DIR/bin/nats-server" -a 127.0.0.1 -p "$NATS_PORT" -c "$WORK/nats.conf" \
    >"$WORK/nats.log" 2>&1 &
  SERVER_PID=$!
  wait_port "$NATS_PORT" 30 || { log "nats-server did not start"; tail -30 "$WORK/nats.log" >&2; return 1; }
  local cmd=("$PEERS_DIR/bin/natsbench" -url "nats://127.0.0.1:$NATS_PORT" -stream BENCH
             -subject bench -size "$SIZE" -total-bytes "$TOTAL" -window 8192 -storage "$storage"
             -timeout "$(publish_timeout)s" ${RATE:+-rate "$RATE" -warmup "$WARMUP"})
  log "nats $variant${RATE:+ at $RATE MB/s} run $run: $COUNT x $SIZE B"
  run_client "${cmd[@]}" || return 1
  local settings
  settings=$(printf '{"nats_server":"%s","storage":"%s","sync_interval":"%s","replicas":1,"subjects":1,"async_publish_window":8192,"store_dir":"%s"}' \
             "$("$PEERS_DIR/bin/nats-server" --version | awk '{print $NF}')" "$storage" "${sync:-default (2m)}" "$(dirname "$WORK")")
  write_result nats "$variant" "$run" "$durability" "$settings" "$(cat "$WORK/client.out")" "${cmd[*]}" || return 1
  stop_server
}

# --- Redis Streams ----------------------------------------------------------------------
redis_run() { # variant run
  local variant=$1 run=$2 durability persist disk=
  case $variant in
    noaof) persist=(--appendonly no)
      durability="XADD reply: the entry is in the server's memory; no AOF and no RDB snapshots" ;;
    aof-everysec) persist=(--appendonly yes --appendfsync everysec)
      durability="XADD reply: the entry is in memory and written to the append-only file (OS page cache) before the reply; a background fsync once a second" ;;
    aof-always) persist=(--appendonly yes --appendfsync always) disk=disk
      durability="XADD reply: the entry is in the append-only file and fsync'd before the reply (appendfsync always; Redis fsyncs once per event-loop pass, so a pipeline's commands share one fsync); AOF on DISK_ROOT" ;;
  esac
  need_free "$REDIS_PORT"
  new_workdir $disk
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$WORK" --save '' "${persist[@]}" \
    --daemonize no --logfile "$WORK/redis.log" &
  SERVER_PID=$!
  wait_port "$REDIS_PORT" 30 || { log "redis-server did not start"; tail -30 "$WORK/redis.log" >&2; return 1; }
  local cmd=("$PEERS_DIR/bin/redisbench" -addr "127.0.0.1:$REDIS_PORT" -key bench -size "$SIZE"
             -total-bytes "$TOTAL" -batch 64 -window 8192 -timeout "$(publish_timeout)s"
             ${RATE:+-rate "$RATE" -warmup "$WARMUP"})
  log "redis $variant${RATE:+ at $RATE MB/s} run $run: $COUNT x $SIZE B"
  run_client "${cmd[@]}" || return 1
  local settings
  settings=$(printf '{"redis_server":"%s","persistence":"%s","save":"","pipeline_batch":64,"window":8192,"dir":"%s"}' \
             "$(redis-server --version | awk '{print $3}' | cut -d= -f2)" "${persist[*]}" "$(dirname "$WORK")")
  write_result redis "$variant" "$run" "$durability" "$settings" "$(cat "$WORK/client.out")" "${cmd[*]}" || return 1
  stop_server
}

# --- Embarcadero (the same workload through `embarcadero bench`) -------------------------
embarcadero_run() { # variant run
  local variant=$1 run=$2 durability args
  case $variant in
    ack1) args=(--order 2 --ack 1)
      durability="ack 1: in the global order, in the shared region's memory; nothing forced to disk" ;;
    ack2) args=(--order 2 --ack 2 --rf 2)
      durability="ack 2: in the global order and fdatasync'd on a disk replica (RF 2) before the acknowledgement" ;;
  esac
  new_workdir
  # The embedded server runs inside the bench process: its CPU is the client's here.
  SERVER_PID=
  # The disk replica goes on a disk (DISK_ROOT), never on tmpfs where fdatasync costs
  # nothing; the region stays under DATA_ROOT like the peers' data.
  REPLICA=$(mktemp -d "$DISK_ROOT/embarcadero-replica.XXXXXX")
  # No ceilings: they run in the same process after the run, and its CPU time is measured.
  local cmd=("$EMBARCADERO_BIN" bench --no-ceilings "${args[@]}" --size "$SIZE" --total-bytes "$TOTAL"
             --linger-us "$EMBARCADERO_LINGER_US" --epoch-us "$EMBARCADERO_EPOCH_US"
             --region-dir "$DATA_ROOT" --replica-dir "$REPLICA"
             ${RATE:+--rate "$RATE" --warmup-messages "$WARMUP"} --json)
  log "embarcadero $variant${RATE:+ at $RATE MB/s} run $run: $COUNT x $SIZE B"
  run_client "${cmd[@]}" || return 1
  local summary
  summary=$(python3 - "$WORK/client.out" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
lat = b["append_to_ack_us"]
rate = b.get("rate_mb_per_s")
late = b.get("schedule_max_lateness_us")
print(json.dumps({
    "messages": b["messages"], "bytes": b["payload_bytes"], "seconds": b["seconds"],
    "mb_per_s": b["mb_per_s"], "msgs_per_s": b["messages_per_s"],
    # Append to ack. At a fixed rate per message, from its due time, as the peers count it;
    # flat out per batch, from the publish of its first message (which waited longest, so
    # this bounds the latency of every message in the batch).
    "latency_ms": {k: lat[k] / 1000 for k in ("p50", "p90", "p99", "max")} | {"p99_9": lat["p999"] / 1000},
    "latency_from": ("scheduled send time of each message, per message" if rate
                     else "publish call of each batch's first message, per batch"),
    "schedule_max_lateness_ms": None if late is None else late / 1000,
    "warmup_messages": b.get("warmup_messages", 0),
    "latency_samples": lat["count"],
    "seal_to_ack_us": b["ack_latency_us"],
    "order": b["order"], "ack": b["ack"], "rf": b["rf"], "brokers": b["brokers"],
}))
PY
) || return 1
  local settings
  settings=$(printf '{"embarcadero":"%s","brokers":4,"batch_bytes":524288,"linger_us":%s,"epoch_us":%s}' \
             "$("$EMBARCADERO_BIN" --version | awk '{print $2}')" "$EMBARCADERO_LINGER_US" "$EMBARCADERO_EPOCH_US")
  write_result embarcadero "$variant" "$run" "$durability" "$settings" "$summary" "${cmd[*]}" || return 1
}

# --- main -------------------------------------------------------------------------------
declare -A VARIANTS=([embarcadero]="ack1 ack2" [kafka]="acks1 acksall acksall-fsync" [nats]="file memory file-sync"
                    [redis]="noaof aof-everysec aof-always")
IFS=, read -r -a peer_list <<<"$PEERS"
for p in "${peer_list[@]}"; do
  case $p in
    embarcadero) [[ -x $EMBARCADERO_BIN ]] || { log "build first: cargo build --release -p embarcadero-cli"; exit 1; } ;;
    kafka) [[ -d $KAFKA_LIBS ]] || { log "kafka not installed: scripts/peers/install.sh kafka"; exit 1; }
           [[ -z $RATES || -f $KAFKABENCH_JAR ]] || { log "kafkabench not built: scripts/peers/install.sh kafka"; exit 1; } ;;
    nats) [[ -x $PEERS_DIR/bin/natsbench ]] || { log "nats not installed: scripts/peers/install.sh nats"; exit 1; } ;;
    redis) [[ -x $PEERS_DIR/bin/redisbench ]] && command -v redis-server >/dev/null \
             || { log "redis not installed: scripts/peers/install.sh redis"; exit 1; } ;;
    *) log "unknown peer $p"; exit 2 ;;
  esac
done
log "total $TOTAL B per run ($COUNT messages of $SIZE B), $RUNS run(s), ${RATES:+offered MB/s: $RATES (after a $WARMUP_S s warm-up), }data in $DATA_ROOT, results in $OUT"
failed=0
for run in $(seq 1 "$RUNS"); do
  for RATE in "${rate_list[@]}"; do
    set_warmup
    for p in "${peer_list[@]}"; do
      for v in ${VARIANTS[$p]}; do
        [[ -z $ONLY_VARIANTS || $ONLY_VARIANTS == *",$v,"* ]] || continue
        if ! "${p}_run" "$v" "$run"; then
          log "FAILED: $p $v${RATE:+ at $RATE MB/s} run $run"; failed=$((failed + 1))
        fi
        cleanup
      done
    done
  done
done
[[ $failed = 0 ]] || { log "$failed run(s) failed"; exit 1; }
