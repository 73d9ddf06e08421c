#!/usr/bin/env bash
# Sets up Tasker (tasker-systems, crates.io 0.1.8) beside Embarcadero, idempotently, everything from
# package registries: a private PostgreSQL 15 cluster (fsync and synchronous_commit on), the pgmq
# extension from the pgmq crate's own install SQL, a PL/pgSQL uuidv7(), tasker-shared's migrations,
# and a release build of tasker-server plus our Rust worker (worker/) into TASKER_CACHE.
# Usage: [TASKER_TARGET_DIR=DIR] [TASKER_NICE=19] scripts/peers/tasker/install.sh [--no-build]
#   [--fresh-db]
#   --fresh-db: drop Tasker's database first, so the schema starts empty (run.sh does this
#   before each Tasker run, as our engine starts from an empty data directory);
#   TASKER_TARGET_DIR: cargo's target directory (default $TASKER_CACHE/target-release, env.sh);
#   TASKER_NICE: the build's niceness (default 19: the machine is shared).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
MANIFEST=$PEER_DIR/worker/Cargo.toml
mkdir -p "$TASKER_CACHE"

# tasker-shared's build script compiles its gRPC protos with protoc (Debian's protobuf-compiler).
ensure_protoc() {
  command -v protoc >/dev/null || apt-get install -y protobuf-compiler >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y protobuf-compiler >/dev/null; }
}

# The source directory of crate $2 (version prefix $3) in the graph of manifest $1, as cargo
# resolved and fetched it into its registry checkout.
crate_dir() {
  cargo fetch --manifest-path "$1" >/dev/null
  cargo metadata --manifest-path "$1" --format-version 1 | python3 -c '
import json, os, sys
name, version = sys.argv[1], sys.argv[2]
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == name and p["version"].startswith(version):
        print(os.path.dirname(p["manifest_path"])); break' "$2" "$3"
}

# Tasker's own pgmq dependency (0.32) downloads its SQL from GitHub at run time; 0.33 embeds it,
# so a throwaway manifest in the cache pulls that version from crates.io.
pgmq_dir() {
  local dir=$TASKER_CACHE/pgmq-sql
  mkdir -p "$dir/src"
  printf '[package]\nname = "pgmq-sql"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\npgmq = "=0.33.7"\n[workspace]\n' >"$dir/Cargo.toml"
  touch "$dir/src/lib.rs"
  crate_dir "$dir/Cargo.toml" pgmq 0.33
}

# pgmq is pure SQL; PostgreSQL 15 only finds extensions in its share directory, so its control
# file (without the C module line, there is no library) and install script go there.
install_pgmq_extension() {
  local src ext version
  src=$(pgmq_dir)/src/install/embedded
  ext=$(pg_config --sharedir)/extension
  version=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$src/pgmq.control")
  grep -v '^module_pathname' "$src/pgmq.control" >"$ext/pgmq.control"
  cp "$src/sql/pgmq.sql" "$ext/pgmq--$version.sql"
}

init_cluster() {
  [ -f "$PGDATA_DIR/PG_VERSION" ] && return
  mkdir -p "$PGDATA_DIR" "$PGSOCK_DIR"
  [ "$(id -u)" = 0 ] && chown postgres "$PGDATA_DIR" "$PGSOCK_DIR"
  as_pg initdb -D "$PGDATA_DIR" -U postgres --auth=trust >/dev/null
  cat >>"$PGDATA_DIR/postgresql.conf" <<EOF
port = $TASKER_PGPORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PGSOCK_DIR'
fsync = on
synchronous_commit = on
max_connections = 300
EOF
}

# Each migration runs once, in one transaction, in file-name order (sqlx's order).
apply_migrations() {
  local dir file name
  dir=$(crate_dir "$MANIFEST" tasker-shared 0.1.8)/migrations
  psql_db -d postgres -tc "SELECT 1 FROM pg_database WHERE datname = 'tasker'" | grep -q 1 ||
    psql_db -d postgres -c 'CREATE DATABASE tasker'
  psql_db -d tasker -f "$PEER_DIR/sql/uuidv7.sql"
  psql_db -d tasker -c 'CREATE TABLE IF NOT EXISTS public.peer_migrations (name text PRIMARY KEY)'
  for file in "$dir"/*.sql; do
    name=$(basename "$file")
    psql_db -d tasker -tc "SELECT 1 FROM peer_migrations WHERE name = '$name'" | grep -q 1 && continue
    echo "applying $name"
    psql_db -d tasker -1 -f "$file" -c "INSERT INTO peer_migrations VALUES ('$name')"
  done
  # The migrations create their functions in schema `tasker` (they SET search_path for
  # themselves), and Tasker's code calls them unqualified (`SELECT pgmq_send_with_notify(...)`):
  # its sessions need the same search path.
  psql_db -d tasker -c 'ALTER DATABASE tasker SET search_path TO tasker, public'
}

# utoipa-swagger-ui (a dependency of tasker-orchestration's web API) downloads Swagger UI from
# GitHub in its build script, which cannot reach GitHub here. The same release is published on
# npm as swagger-ui-dist: repackage it in the layout the build script reads (TOP/dist/...) and
# point its documented SWAGGER_UI_DOWNLOAD_URL at the file.
SWAGGER_UI_VERSION=5.17.14
swagger_ui_zip() {
  local zip=$TASKER_CACHE/swagger-ui-$SWAGGER_UI_VERSION.zip
  if [ ! -s "$zip" ]; then
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "swagger-ui-dist@$SWAGGER_UI_VERSION" >/dev/null &&
      tar xzf "swagger-ui-dist-$SWAGGER_UI_VERSION.tgz")
    python3 - "$tmp/package" "$zip" "swagger-ui-$SWAGGER_UI_VERSION/" <<'PY'
import pathlib, sys, zipfile
src, out, top = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr(top, "")
    z.writestr(top + "dist/", "")
    for f in sorted(src.rglob("*")):
        if f.is_file():
            z.write(f, top + "dist/" + f.relative_to(src).as_posix())
PY
    rm -rf "$tmp"
  fi
  export SWAGGER_UI_DOWNLOAD_URL="file://$zip"
}

build() {
  local log=$CARGO_TARGET_DIR/build.log
  swagger_ui_zip
  mkdir -p "$CARGO_TARGET_DIR"
  echo "building tasker-server and tasker-bench-worker into $CARGO_TARGET_DIR (log: $log)"
  # SQLX_OFFLINE: sqlx's query macros check against the query data the crates ship (.sqlx/)
  # instead of a live database, as published sqlx crates are meant to be built.
  SQLX_OFFLINE=true nice -n "${TASKER_NICE:-19}" cargo build --release --manifest-path "$MANIFEST" \
    >"$log" 2>&1 ||
    { tail -30 "$log"; exit 1; }
}

BUILD=1 FRESH=0
for arg in "$@"; do
  case $arg in
    --no-build) BUILD=0 ;;
    --fresh-db) FRESH=1 ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
ensure_protoc
install_pgmq_extension
init_cluster
start_pg
[ $FRESH = 0 ] || psql_db -d postgres -c 'DROP DATABASE IF EXISTS tasker WITH (FORCE)'
apply_migrations
[ $BUILD = 0 ] || build
echo "tasker installed: PostgreSQL on 127.0.0.1:$TASKER_PGPORT, binaries in $TASKER_BIN"
