#!/usr/bin/env bash
# The GPU backend's device checks (issue 16) as one call of the device tool
# (see ../.library/device): the kernels against the CPU kernels, greedy
# tokens of the GPU engine against the CPU engine on synthetic 7B-shape
# models (the real models' files are larger than a call may carry; the
# device machine reaches no network), Table 3, and decode tokens/s against
# llama.cpp's CUDA build of the same GGUF (the reference llama.cpp source,
# built there with the device's nvcc while the other checks run).
#
#   scripts/gpu_check.sh build   here: release binaries into .gpu/ (git-ignored)
#   scripts/gpu_check.sh run     there, with `.gpu` carried: the log and JSON
#                                lines go to $OUT (or ./gpu-check-out)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
  rm -rf .gpu && mkdir -p .gpu
  cargo build --release -p leanstream-cuda --examples
  cargo build --release --bin leanstream
  cp "$CARGO_TARGET_DIR/release/examples/greedy" "$CARGO_TARGET_DIR/release/examples/table3" \
    "$CARGO_TARGET_DIR/release/leanstream" .gpu/
  # The test executables, by the names cargo reports for them.
  cargo test --release -p leanstream-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".gpu/test-" + m["target"]["name"])
'
  # The reference llama.cpp's sources a CUDA build of llama-bench needs (~10 MB).
  src=$(dirname "$(scripts/llama_cpp.sh)")/..
  tar -C "$src" --exclude=.git --exclude=build -czf .gpu/llama-src.tgz \
    CMakeLists.txt cmake ggml src include common tools vendor licenses LICENSE
  du -sh .gpu && ls .gpu
  ;;
run)
  out=${OUT:-gpu-check-out}
  mkdir -p "$out"
  exec > >(tee "$out/gpu-check.log") 2>&1
  # The device's CUDA toolkit provides NVRTC; cudarc looks for it as libnvrtc.so too.
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  # llama.cpp's CUDA build, in the background on most of the cores.
  mkdir -p /tmp/llama && tar -C /tmp/llama -xzf .gpu/llama-src.tgz
  (cmake -S /tmp/llama -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF &&
    cmake --build /tmp/llama/build -j"$(($(nproc) - 2))" --target llama-bench) >"$out/llama-build.log" 2>&1 &
  llama_build=$!
  .gpu/test-nvrtc
  .gpu/test-device --test-threads=1 --nocapture
  for layers in 2 32; do
    m=/tmp/mistral-$layers.gguf
    .gpu/leanstream synthetic --shape mistral-7b --layers "$layers" -o "$m"
    .gpu/greedy "$m" "The license grants" 16 | tee -a "$out/greedy.jsonl"
  done
  .gpu/table3 20 | tee "$out/table3.jsonl"
  if wait "$llama_build"; then
    # Our device engine and llama.cpp's CUDA build on the same GGUF, run by run.
    .gpu/leanstream bench --model /tmp/mistral-32.gguf --device cuda --prompt-tokens 512 --gen-tokens 32 \
      --reps 3 --llama-bench /tmp/llama/build/bin/llama-bench | tee "$out/bench-cuda.json"
  else
    echo "llama.cpp's CUDA build failed:" && tail -30 "$out/llama-build.log"
  fi
  ;;
*)
  echo "usage: scripts/gpu_check.sh build|run" >&2
  exit 2
  ;;
esac
