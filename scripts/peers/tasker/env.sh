# shellcheck shell=bash disable=SC2034
# Shared settings for the Tasker peer scripts (sourced by install.sh and run.sh): where the cache,
# the private PostgreSQL cluster and the binaries live, and how to start and reach that cluster.
# Everything built or stored lives outside the repository, under TASKER_CACHE.
TASKER_CACHE=${TASKER_CACHE:-/work/cache/tasker}
TASKER_PGPORT=${TASKER_PGPORT:-55432}
PGDATA_DIR=$TASKER_CACHE/pg
PGSOCK_DIR=$TASKER_CACHE/pgsock
# The build of worker/ (plain release profile). TASKER_TARGET_DIR picks another one, e.g. the
# earlier build with libraries at opt-level 1 in $TASKER_CACHE/target (docs/BENCHMARKS.md).
export CARGO_TARGET_DIR=${TASKER_TARGET_DIR:-$TASKER_CACHE/target-release}
TASKER_BIN=$CARGO_TARGET_DIR/release
export DATABASE_URL="postgresql://postgres:trust@127.0.0.1:$TASKER_PGPORT/tasker"
PEER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# initdb and postgres refuse to run as root; the cluster belongs to the postgres user when we are root.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_running() {
  as_pg pg_ctl -D "$PGDATA_DIR" status >/dev/null 2>&1
}

start_pg() {
  pg_running || as_pg pg_ctl -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w start >/dev/null
}

psql_db() {
  PGOPTIONS="-c client_min_messages=warning" psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$TASKER_PGPORT" -U postgres "$@"
}
