#!/usr/bin/env bash
# Installs the peer systems that scripts/peers/run.sh benchmarks beside Embarcadero:
#   - Apache Kafka (KRaft) as jars resolved from Maven Central with mvn, into a classpath dir,
#     and the kafkabench fixed-rate load generator (kafkabench/, built with mvn);
#   - NATS server (JetStream) built with `go install`, and the natsbench client (natsbench/);
#   - Redis from Debian's packages, and the redisbench client (redisbench/).
# Everything goes under $PEERS_DIR (default $HOME/.cache/embarcadero-peers) except the Debian
# packages. Idempotent: a component already installed at the pinned version is skipped.
# Only package registries are used (Maven Central, the Go module proxy, Debian).
#
# Usage: scripts/peers/install.sh [kafka|nats|redis|plot ...]   (default: all four; plot is
# matplotlib from PyPI in $PEERS_DIR/venv, for summarize.py --plot)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/embarcadero-peers}
# Pinned versions (override from the environment to try another one).
KAFKA_VERSION=${KAFKA_VERSION:-4.1.0}
SLF4J_VERSION=${SLF4J_VERSION:-2.0.17}
NATS_SERVER_VERSION=${NATS_SERVER_VERSION:-v2.15.2}

log() { printf '[install] %s\n' "$*" >&2; }

mkdir -p "$PEERS_DIR/bin"

install_kafka() {
  local dir="$PEERS_DIR/kafka-$KAFKA_VERSION"
  if [[ -f "$dir/.installed" ]]; then
    log "kafka $KAFKA_VERSION already in $dir"
  else
    install_kafka_libs "$dir"
  fi
  build_kafkabench "$dir"
}

install_kafka_libs() {
  local dir=$1
  command -v mvn >/dev/null || { log "mvn not found (apt-get install maven)"; exit 1; }
  command -v java >/dev/null || { log "java not found (Kafka 4.x needs Java 17+)"; exit 1; }
  log "resolving kafka $KAFKA_VERSION from Maven Central into $dir/libs"
  mkdir -p "$dir"
  # A throwaway project whose only purpose is to list the dependencies to copy.
  cat > "$dir/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>embarcadero.peers</groupId>
  <artifactId>kafka-classpath</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka-tools</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-api</artifactId>
      <version>$SLF4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-simple</artifactId>
      <version>$SLF4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
  rm -rf "$dir/libs"
  if ! (cd "$dir" && mvn -B -Dstyle.color=never dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$dir/libs") >"$dir/mvn.log" 2>&1; then
    tail -40 "$dir/mvn.log" >&2; log "mvn failed (log: $dir/mvn.log)"; exit 1
  fi
  # Exactly one SLF4J provider on the classpath: keep slf4j-simple, drop any other binding
  # that a transitive dependency may have brought in.
  find "$dir/libs" -name 'slf4j-reload4j-*.jar' -o -name 'log4j-slf4j*-impl-*.jar' \
    | xargs -r rm -f
  local n
  n=$(ls "$dir/libs" | wc -l)
  local listing="$dir/classes.txt"
  (cd "$dir/libs" && for j in *.jar; do unzip -Z1 "$j" 2>/dev/null; done) > "$listing"
  for cls in kafka/Kafka.class org/apache/kafka/tools/ProducerPerformance.class; do
    grep -qx "$cls" "$listing" || { log "class $cls not found in $dir/libs"; exit 1; }
  done
  echo "$KAFKA_VERSION" > "$dir/.installed"
  log "kafka $KAFKA_VERSION: $n jars in $dir/libs"
}

# kafkabench (kafkabench/): the fixed-rate Kafka load generator, compiled against the same
# kafka-clients version and run on the classpath above. Rebuilt only when its sources or the
# Kafka version changed; built in a copy under $dir so the source tree stays clean.
build_kafkabench() {
  local dir=$1 src="$HERE/kafkabench" sum
  sum=$( (echo "$KAFKA_VERSION"; cat "$src/pom.xml"; find "$src/src" -type f | sort | xargs cat) \
         | sha256sum | cut -c1-16)
  if [[ -f "$dir/kafkabench.jar" && -f "$dir/.kafkabench-$sum" ]]; then
    log "kafkabench up to date"
    return
  fi
  command -v mvn >/dev/null || { log "mvn not found (apt-get install maven)"; exit 1; }
  log "building kafkabench against kafka-clients $KAFKA_VERSION"
  local build="$dir/kafkabench-build"
  rm -rf "$build"
  mkdir -p "$build"
  cp -r "$src/pom.xml" "$src/src" "$build/"
  if ! (cd "$build" && mvn -B -Dstyle.color=never -DskipTests -Dkafka.version="$KAFKA_VERSION" \
        package) >"$build/mvn.log" 2>&1; then
    tail -40 "$build/mvn.log" >&2; log "kafkabench build failed (log: $build/mvn.log)"; exit 1
  fi
  cp "$build/target/kafkabench.jar" "$dir/kafkabench.jar"
  rm -f "$dir"/.kafkabench-*
  touch "$dir/.kafkabench-$sum"
}

install_nats() {
  command -v go >/dev/null || { log "go not found"; exit 1; }
  local stamp="$PEERS_DIR/bin/.nats-server-$NATS_SERVER_VERSION"
  if [[ -x "$PEERS_DIR/bin/nats-server" && -f "$stamp" ]]; then
    log "nats-server $NATS_SERVER_VERSION already in $PEERS_DIR/bin"
  else
    log "go install nats-server $NATS_SERVER_VERSION"
    GOBIN="$PEERS_DIR/bin" GOFLAGS=-buildvcs=false \
      go install "github.com/nats-io/nats-server/v2@$NATS_SERVER_VERSION"
    rm -f "$PEERS_DIR"/bin/.nats-server-*
    touch "$stamp"
  fi
  build_client natsbench
}

# Builds one of the Go clients in this directory, again only when its sources (or those of
# loadgen/, the package they share) changed.
build_client() {
  local name=$1 src="$HERE/$1" sum
  sum=$(cat "$src"/go.* "$src"/*.go "$HERE"/loadgen/go.mod "$HERE"/loadgen/*.go | sha256sum | cut -c1-16)
  if [[ -x "$PEERS_DIR/bin/$name" && -f "$PEERS_DIR/bin/.$name-$sum" ]]; then
    log "$name up to date"
    return
  fi
  log "building $name"
  (cd "$src" && GOFLAGS="-buildvcs=false -mod=mod" go build -o "$PEERS_DIR/bin/$name" .)
  rm -f "$PEERS_DIR/bin/.$name-"*
  touch "$PEERS_DIR/bin/.$name-$sum"
}

install_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    log "redis already installed: $(redis-server --version | cut -d' ' -f3)"
  else
    log "apt-get install redis-server redis-tools"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache policy redis-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
      apt-get update -qq
    fi
    # run.sh starts its own redis-server on its own port; keep the package's service (if the
    # package's scripts start one) from running alongside the benchmark.
    local prc=/usr/sbin/policy-rc.d created=0
    if [[ ! -e $prc ]]; then
      printf '#!/bin/sh\nexit 101\n' > $prc; chmod +x $prc; created=1
    fi
    local rc=0
    apt-get install -y -qq redis-server redis-tools >/dev/null || rc=$?
    if [[ $created = 1 ]]; then rm -f $prc; fi
    [[ $rc = 0 ]] || { log "apt-get install failed ($rc)"; exit 1; }
  fi
  build_client redisbench
}

# matplotlib (PyPI) in a virtual environment, for `summarize.py --plot`.
install_plot() {
  local venv="$PEERS_DIR/venv"
  if [[ -x $venv/bin/python3 ]] && "$venv/bin/python3" -c 'import matplotlib' 2>/dev/null; then
    log "matplotlib already in $venv"
    return
  fi
  log "pip install matplotlib into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q matplotlib
}

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(kafka nats redis plot)
for t in "${targets[@]}"; do
  case $t in
    kafka) install_kafka ;;
    nats) install_nats ;;
    redis) install_redis ;;
    plot) install_plot ;;
    *) log "unknown peer $t (kafka|nats|redis|plot)"; exit 2 ;;
  esac
done
log "done: PEERS_DIR=$PEERS_DIR"
