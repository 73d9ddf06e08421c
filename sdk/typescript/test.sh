#!/usr/bin/env bash
# The TypeScript client's suite, run by scripts/test.sh with EMBARCADERO_BIN set to the
# cargo-built server. `npm ci` installs the devDependencies (napi-rs CLI, TypeScript,
# Node's types; from the npm registry, pinned by package-lock.json) into node_modules here
# and, through the `prepare` script, builds the native addon and the TypeScript; then
# `node --test` runs the suite against real servers.
#
# The addon is a debug build with no optimisation and no debug info anywhere (Cargo.toml's
# dev profile): the cheapest compile on CI's two cores, and the suite measures no speed.
# `npm run bench` builds the release addon instead.
set -euo pipefail
cd "$(dirname "$0")"
: "${EMBARCADERO_BIN:?set EMBARCADERO_BIN to the embarcadero binary (scripts/test.sh does)}"
export EMBARCADERO_BIN
# This crate is outside the workspace that .ci/run formats and lints: check its format
# here (no compile); `cargo clippy --all-targets -- -D warnings` is clean too, run by hand.
cargo fmt --manifest-path Cargo.toml --check
npm ci --no-audit --no-fund
# The published declarations, checked as a consumer with `skipLibCheck: false` sees them
# (build/ts/native.d.ts named a file the package did not ship).
npm run -s check:types
node --test --test-concurrency=1 build/test/*.test.js
