#!/usr/bin/env bash
# Builds the leanstream binary for the benchmark scripts and prints its path.
# PROFILE: release (default), or ci to reuse scripts/test.sh's build, whose
# binary has the features the whole workspace unifies (a plain
# `cargo build --bin` with other features would build everything again).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
profile=${PROFILE:-release}
if [ "$profile" = ci ]; then
  cargo test --profile ci --workspace --no-run >&2
else
  cargo build --profile "$profile" --bin leanstream >&2
fi
echo "$CARGO_TARGET_DIR/$profile/leanstream"
