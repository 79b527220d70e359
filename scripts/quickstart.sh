#!/usr/bin/env bash
# The main job on the default model: tune it for this machine (a short,
# resumable run with a progress bar; run again, it finds its steps done and
# reuses what it made), then generate through the streaming engine under a
# memory budget, driven by the tune's controller table and predictor.
#
# Usage: scripts/quickstart.sh [PROMPT]
# Env: MODEL (smollm2), BUDGET (5m), MEM_BUDGET (100MiB), SPARSITY (0.5),
#      OUT ($LEANSTREAM_HOME/tuned/MODEL), TEXT (data/text/gpl-3.0.txt),
#      CONTROLLER (default: the tuned table beside the model; or e.g.
#      fixed:K=2,b=1.5,d=8,q=16 to pin one action)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
model=${MODEL:-smollm2}
out=${OUT:-$home/tuned/$model}
prompt=${1:-Name three rivers in Europe.}
# Both binaries in one build: tune's verification step runs leanstream.
cargo build --release --bin leanstream --bin leanstream-synth
bin=$CARGO_TARGET_DIR/release
"$bin/leanstream-synth" tune --model "$model" --text "${TEXT:-data/text/gpl-3.0.txt}" --budget "${BUDGET:-5m}" \
  --out "$out"
controller=()
[ -z "${CONTROLLER:-}" ] || controller=(--controller "$CONTROLLER")
"$bin/leanstream" run --model "$out/model.lsflash" --policy speculate --sparsity "${SPARSITY:-0.5}" \
  --mem-budget "${MEM_BUDGET:-100MiB}" "${controller[@]}" --chat --prompt "$prompt" -n 64 --temp 0
