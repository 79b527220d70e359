#!/usr/bin/env bash
# Does the controller table earn its place in the real engine? Sweeps
# `speculate` over the table and every action of its codebook pinned for
# every layer, scores each run by the control model's own cost measured in
# the engine, then confirms the table against the sweep's best fixed
# actions in fresh paired rounds (how, and why: scripts/sweep_codebook.py).
#
# Usage: scripts/sweep_codebook.sh FLASH [TABLE]   (default TABLE: the one
#        `leanstream run` would use: beside the model, else data/controller/)
# Env: BUDGET (25%), SPARSITY (0.5), GEN (32), REPS (2), OUT (JSON lines;
#      default $LEANSTREAM_HOME/sweep-codebook/<stem>.jsonl), SWEEP (1; 0
#      reuses OUT's sweep rows), CONFIRM_TOP (5; 0 skips the confirmation),
#      CONFIRM_REPS (8), CONFIRM_ALSO (more tables to confirm against, space
#      separated), QUALITY_TEXT (held-out text: the engine's recall per
#      breadth is audited on it, and each contender's quality; without it
#      the offline recall in the table's settings scores the runs),
#      QUALITY_CHUNKS (4), QUALITY_CTX (256), PROFILE (the cargo profile of
#      the binaries; release).
# Needs the predictor beside the model (scripts/bench_speculate.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
flash=$1
stem=$(basename "$flash" .lsflash)
table=${2:-}
if [ -z "$table" ]; then
  for t in "${flash%.lsflash}.lstab" "$(dirname "$flash")/controller.lstab" data/controller/controller.lstab; do
    [ -f "$t" ] && { table=$t; break; }
  done
fi
export OUT=${OUT:-$home/sweep-codebook/$stem.jsonl}
mkdir -p "$(dirname "$OUT")"
profile=${PROFILE:-release}
cargo build --profile "$profile" --bin leanstream --bin leanstream-synth >&2
bin=$CARGO_TARGET_DIR/$profile
settings=$("$bin/leanstream-synth" inspect "$table" --svg /dev/null | sed -n 's/^solver settings: //p')
exec python3 scripts/sweep_codebook.py "$bin/leanstream" "$flash" "$table" "$settings"
