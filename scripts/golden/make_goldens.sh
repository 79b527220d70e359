#!/usr/bin/env bash
# Regenerates LeanStream's llama.cpp golden outputs in data/golden/.
#
# llama.cpp is the copy vendored by the llama-cpp-python 0.3.36 source package
# on PyPI, built natively for this CPU by scripts/llama_cpp.sh (override with
# LLAMA=path/to/llama.cpp). Models come from `leanstream fetch`, or env
# LEANSTREAM_SMOLLM2 / LEANSTREAM_GEMMA3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
LLAMA_BIN=${LLAMA_BIN:-$("$root/scripts/llama_cpp.sh")}
LLAMA=${LLAMA:-$LLAMA_BIN/../..}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
SMOLLM2=${LEANSTREAM_SMOLLM2:-$home/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
GEMMA3=${LEANSTREAM_GEMMA3:-$home/models/gemma3/gemma-3-270m-q4_k_m.gguf}
out=$root/data/golden
tools=$home/tools
mkdir -p "$tools"
tool=$tools/golden_llama

g++ -O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" "$here/golden_llama.cpp" \
    -L"$LLAMA_BIN" -lllama -lggml -lggml-base -Wl,-rpath,"$LLAMA_BIN" -o "$tool"

prompts=(
  "The capital of France is"
  "Once upon a time, in a small village by the sea,"
  "def fibonacci(n):"
  "The three primary colors are"
  "Water boils at a temperature of"
  "In 1969, the first humans to walk on the Moon were"
  # 64 tokens or more: llama.cpp's flash attention takes its tiled route for the prompt.
  "The GNU General Public License is a free, copyleft license for software and other kinds of works. The licenses for most software and other practical works are designed to take away your freedom to share and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom to share and change all versions of a program--to make sure it remains free software for all its users. We, the Free Software Foundation, use the GNU General Public License for most of our software; it applies also to any other work released this way by its authors."
)

long_prompt=$(head -c 5600 "$root/data/text/gpl-3.0.txt")

# Goldens for each attention path: flash attention off (the files without a
# suffix) and on (-fa-on), llama.cpp's default on a CPU.
run_model() { # name path chat_prompt
  local name=$1 path=$2 chat=$3 fa suffix ppl chunks log
  for fa in off on; do
    suffix=$([ $fa = on ] && echo -fa-on || true)
    "$tool" "$path" 32 --fa $fa "${prompts[@]}" "$chat" > "$out/generate-$name$suffix.jsonl"
    # Past 1024 positions: Gemma 3's sliding-window cache (window + 512 cells) wraps around.
    "$tool" "$path" 32 --fa $fa --ctx 2048 "$long_prompt" > "$out/generate-$name-long$suffix.jsonl"
    log=$("$LLAMA_BIN/llama-perplexity" -m "$path" -f "$root/data/text/gpl-3.0.txt" \
          -c 2048 -b 2048 -t 2 -fa $fa --chunks 2 2>&1)
    ppl=$(sed -n 's/.*Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\).*/\1 \2/p' <<<"$log")
    printf '{"model":"%s","file":"data/text/gpl-3.0.txt","ctx":2048,"flash_attn":"%s","chunks":2,"ppl":%s,"ppl_stderr":%s}\n' \
      "$name" "$fa" ${ppl% *} ${ppl#* } > "$out/perplexity-$name-ctx2048$suffix.json"
    log=$("$LLAMA_BIN/llama-perplexity" -m "$path" -f "$root/data/text/gpl-3.0-excerpt.txt" \
          -c 256 -b 256 -t 2 -fa $fa 2>&1)
    ppl=$(sed -n 's/.*Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\).*/\1 \2/p' <<<"$log")
    chunks=$(sed -n 's/.*calculating perplexity over \([0-9]*\) chunks.*/\1/p' <<<"$log")
    printf '{"model":"%s","file":"data/text/gpl-3.0-excerpt.txt","ctx":256,"flash_attn":"%s","chunks":%s,"ppl":%s,"ppl_stderr":%s}\n' \
      "$name" "$fa" "$chunks" ${ppl% *} ${ppl#* } > "$out/perplexity-$name$suffix.json"
  done
}

# Flash attention itself, by each of its three CPU routes.
gcc -O2 -I"$LLAMA/ggml/include" "$here/golden_flash_attn.c" -L"$LLAMA_BIN" -lggml -lggml-base -lggml-cpu -lm \
    -Wl,-rpath,"$LLAMA_BIN" -o $tools/golden_flash_attn
$tools/golden_flash_attn > "$out/flash_attn.json"

# Kernel-level: activation quantization + dot products on deterministic rows.
gcc -O2 -I"$LLAMA/ggml/include" "$here/golden_vec_dot.c" -L"$LLAMA_BIN" -lggml -lggml-base -lggml-cpu \
    -Wl,-rpath,"$LLAMA_BIN" -o $tools/golden_vec_dot
$tools/golden_vec_dot > "$out/vec_dot.json"
# Q4_K matrix products through the CPU backend's repack buffer (as llama.cpp runs Q4_K weights).
gcc -O2 -I"$LLAMA/ggml/include" "$here/golden_q4k_repack.c" -L"$LLAMA_BIN" -lggml -lggml-base -lggml-cpu \
    -Wl,-rpath,"$LLAMA_BIN" -o $tools/golden_q4k_repack
$tools/golden_q4k_repack > "$out/q4k_repack.json"
# K-quant products with 8+ activation rows: llama.cpp's tiled K-quant matmul (plain CPU buffer).
gcc -O2 -I"$LLAMA/ggml/include" "$here/golden_tiled_kquant.c" -L"$LLAMA_BIN" -lggml -lggml-base -lggml-cpu \
    -Wl,-rpath,"$LLAMA_BIN" -o $tools/golden_tiled_kquant
$tools/golden_tiled_kquant > "$out/tiled_kquant.json"

run_model smollm2 "$SMOLLM2" $'<|im_start|>user\nWhat is the tallest mountain on Earth?<|im_end|>\n<|im_start|>assistant\n'
run_model gemma3 "$GEMMA3" $'<start_of_turn>user\nWhat is the tallest mountain on Earth?<end_of_turn>\n<start_of_turn>model\n'

commit=$(git -C "$LLAMA" log -1 --format=%H 2>/dev/null || echo unknown)
cat > "$out/llama_cpp_version.txt" <<INFO
llama.cpp vendored by llama-cpp-python 0.3.36 (PyPI sdist), commit $commit
built: cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON; run with 2 threads, flash attention off and on
command: scripts/golden/make_goldens.sh
INFO
echo "goldens written to $out"
