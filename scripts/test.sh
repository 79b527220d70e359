#!/usr/bin/env bash
# Fetches the two reference models into the cache (once), then runs every test.
# Tests that need a model skip with a visible SKIPPED line when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
cargo build --release --bin leanstream
for m in smollm2 gemma3; do
  "$CARGO_TARGET_DIR/release/leanstream" fetch "$m" || echo "warning: could not fetch $m; its tests will be skipped" >&2
done
# The release profile: the tests reuse the build above (and CI builds once).
cargo test --release --workspace --no-fail-fast "$@"
