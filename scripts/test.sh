#!/usr/bin/env bash
# Fetches the two reference models into the cache (once), then runs every test.
# A test that needs a missing model fails; on an offline machine set
# LEANSTREAM_ALLOW_MISSING_MODELS=1 to have those tests skip (SKIPPED lines).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
cargo build --release --bin leanstream
for m in smollm2 gemma3; do
  if ! "$CARGO_TARGET_DIR/release/leanstream" fetch "$m"; then
    [ "${LEANSTREAM_ALLOW_MISSING_MODELS:-}" = 1 ] || { echo "error: could not fetch $m (set LEANSTREAM_ALLOW_MISSING_MODELS=1 to skip its tests)" >&2; exit 1; }
    echo "warning: could not fetch $m; its tests will be skipped" >&2
  fi
done
# The release profile: the tests reuse the build above (and CI builds once).
cargo test --release --workspace --no-fail-fast "$@"
