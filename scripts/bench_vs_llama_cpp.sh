#!/usr/bin/env bash
# Dense prompt and decode speed of LeanStream against llama.cpp's llama-bench,
# interleaved in one run per model and attention path, same GGUF, same
# thread count, flash attention off and on (llama.cpp's CPU default) alike.
# Usage: scripts/bench_vs_llama_cpp.sh [THREADS] [PROMPT_TOKENS] [GEN_TOKENS] [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2} p=${2:-512} g=${3:-128} reps=${4:-5}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
cargo build --release --bin leanstream >&2
bin=$(scripts/llama_cpp.sh)
for m in smollm2 gemma3; do
  for fa in off on; do
    "$CARGO_TARGET_DIR/release/leanstream" --threads "$threads" bench --model "$m" --flash-attn "$fa" \
      --prompt-tokens "$p" --gen-tokens "$g" --reps "$reps" --json --llama-bench "$bin/llama-bench"
  done
done
