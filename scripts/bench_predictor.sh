#!/usr/bin/env bash
# Activation traces, predictors and placement for each model, judged on
# held-out text: recall, perplexity with predicted sets, size and latency
# (also at Mistral-7B shape), reads per token of the placement.
#   scripts/bench_predictor.sh smollm2 gemma3
# Env: TOKENS (training tokens, 12288), EPOCHS (4), PREDICTOR_ARGS (extra
# `leanstream-synth predictor` flags), OUT (default $LEANSTREAM_HOME/predictor).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
out=${OUT:-$home/predictor}
cargo build --release --bin leanstream-profile --bin leanstream-synth
bin=$CARGO_TARGET_DIR/release
read -r train heldout < <(scripts/prepare_text.sh)
mkdir -p "$out"
for m in "${@:-smollm2 gemma3}"; do
  for name in $m; do
    acts=$home/acts/$name
    # Same command again continues an interrupted recording.
    "$bin/leanstream-profile" activations --model "$name" --text "$train" --heldout "$heldout" \
      -o "$acts" --max-tokens "${TOKENS:-12288}"
    "$bin/leanstream-synth" predictor --acts "$acts" -o "$out/$name.lspred" \
      --baseline "$out/$name-lowrank.lspred" --epochs "${EPOCHS:-4}" ${PREDICTOR_ARGS:-} > "$out/$name-train.json"
    "$bin/leanstream-synth" placement --acts "$acts" -o "$out/$name-placement.json" --json > "$out/$name-placement-eval.json"
    "$bin/leanstream-synth" eval --acts "$acts" --predictor "$out/$name.lspred" "$out/$name-lowrank.lspred" \
      --placement "$out/$name-placement.json" --shape-7b > "$out/$name-eval.json"
    echo "$out/$name-eval.json"
  done
done
