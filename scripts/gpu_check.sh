#!/usr/bin/env bash
# The GPU backend's device checks (issue 16), built here and run on a lent
# GPU machine (see ../.library/device): the kernels against the CPU kernels,
# greedy tokens of the device engine against the CPU engine (synthetic
# 7B-shape models and the two real models), a packed model on the device
# (its bundles resident, and streamed from flash, also under the CPU
# engine's policies at sparsity 0.5),
# the compute profile of the device's kernels, Table 3, perplexity decoded
# on the device (dense and under policies), and decode tokens/s
# against llama.cpp's CUDA build of the same GGUF (the reference llama.cpp
# source, built there with the device's nvcc while the other checks run).
#
# A call carries at most 64 MiB and the machine reaches no network, so the
# binaries travel compressed (.gpu/, git-ignored) and the real models in
# chunks (.m/, git-ignored), one a call; each call stashes its chunk in the
# machine's /tmp, which stays while the machine is warm between calls.
#
#   scripts/gpu_check.sh build [llama]  here: binaries into .gpu/ (with the
#                                       llama.cpp sources: `llama`)
#   scripts/gpu_check.sh chunks         here: the real models, compressed and
#                                       cut into .m-chunks/ (copy one a call to .m/)
#   scripts/gpu_check.sh run            there, .gpu carried: kernel tests, a
#                                       synthetic model's greedy tokens (LAYERS,
#                                       default "2 32"), Table 3 (unless NO_TABLE3)
#   scripts/gpu_check.sh stash          there, .m carried: stash the chunk
#   scripts/gpu_check.sh models         there, .gpu carried, every chunk stashed:
#                                       the real models' checks (NO_BENCH: greedy only)
# Logs and JSON lines go to $OUT (or ./gpu-check-out).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}

# The chunk this call carries into /tmp/chunks; the device's CUDA toolkit
# on the loader's path (cudarc looks for libnvrtc.so there too); the
# binaries unpacked.
prepare() {
  mkdir -p /tmp/chunks "$out"
  if [ -d .m ]; then cp .m/* /tmp/chunks/; fi
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
  for f in .gpu/*.xz; do
    [ -e "$f" ] || continue
    xz -dc "$f" >"${f%.xz}" && chmod +x "${f%.xz}"
  done
}

case "${1:-}" in
build)
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
  rm -rf .gpu && mkdir -p .gpu
  cargo build --release -p leanstream-cuda --examples
  cargo build --release --bin leanstream --bin leanstream-profile
  cp "$CARGO_TARGET_DIR/release/examples/greedy" "$CARGO_TARGET_DIR/release/examples/table3" \
    "$CARGO_TARGET_DIR/release/leanstream" "$CARGO_TARGET_DIR/release/leanstream-profile" .gpu/
  # The test executables, by the names cargo reports for them.
  cargo test --release -p leanstream-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".gpu/test-" + m["target"]["name"])
'
  # Predictors for the 2-layer 7B-shape model the `run` step makes there
  # (seeded, so the same bytes, whose hash they name): recorded and trained
  # here in under a minute, not on device time.
  cargo build --release --bin leanstream-synth
  w=$(mktemp -d)
  rel=$CARGO_TARGET_DIR/release
  "$rel/leanstream" synthetic --shape mistral-7b --layers 2 -o "$w/m.gguf" >/dev/null
  "$rel/leanstream-profile" activations --model "$w/m.gguf" --text data/text/apache-2.0.txt \
    --heldout data/text/gpl-3.0-excerpt.txt -o "$w/acts" --max-tokens 1024 >/dev/null
  "$rel/leanstream-synth" predictor --acts "$w/acts" -o .gpu/mistral-2.lspred --sparsity 0.5 \
    --baseline .gpu/mistral-2.lowrank.lspred --quiet >/dev/null
  rm -rf "$w"
  xz -T0 -6 .gpu/*
  if [ "${2:-}" = llama ]; then
    # The reference llama.cpp's sources a CUDA build of llama-bench needs (~10 MB).
    src=$(dirname "$(scripts/llama_cpp.sh)")/..
    tar -C "$src" --exclude=.git --exclude=build -czf .gpu/llama-src.tgz \
      CMakeLists.txt cmake ggml src include common tools vendor licenses LICENSE
  fi
  du -sh .gpu && ls .gpu
  ;;
chunks)
  grep -qx '/.m/' .git/info/exclude 2>/dev/null || echo /.m/ >>.git/info/exclude
  grep -qx '/.m-chunks/' .git/info/exclude 2>/dev/null || echo /.m-chunks/ >>.git/info/exclude
  models=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}/models
  rm -rf .m-chunks && mkdir -p .m-chunks
  files=(smollm2/SmolLM2-135M-Instruct.Q4_1.gguf gemma3/gemma-3-270m-q4_k_m.gguf)
  (cd "$models" && sha256sum "${files[@]}") >.m-chunks/SHA256SUMS
  tar -C "$models" -c "${files[@]}" | xz -T0 -6 | split -b 61000000 -d - .m-chunks/models.tar.xz.
  ls -la .m-chunks
  ;;
run)
  prepare
  exec > >(tee "$out/gpu-check.log") 2>&1
  # From here a failing check is reported and the next one still runs.
  set +e
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  if [ -f .gpu/llama-src.tgz ]; then
    # llama.cpp's CUDA build in its own session: it outlives this call.
    mkdir -p /tmp/llama && tar -C /tmp/llama -xzf .gpu/llama-src.tgz
    setsid nohup bash -c 'cmake -S /tmp/llama -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF &&
      cmake --build /tmp/llama/build -j"$(($(nproc) - 2))" --target llama-bench; echo $? >/tmp/llama/rc' \
      >/tmp/llama/build.log 2>&1 </dev/null &
  fi
  .gpu/test-nvrtc
  .gpu/test-flag_protocol
  .gpu/test-device --test-threads=1 --nocapture
  for layers in ${LAYERS:-2 32}; do
    m=/tmp/mistral-$layers.gguf
    .gpu/leanstream synthetic --shape mistral-7b --layers "$layers" -o "$m"
    .gpu/greedy "$m" "The license grants" 16 | tee -a "$out/greedy.jsonl"
  done
  # The streamed FFN: a 2-layer 7B-shape model packed, its bundles read
  # from flash each token through a quarter-size cache and landed while the
  # kernels poll, against the same bundles resident on the device (the
  # same slots in the same order: the same text).
  .gpu/test-stream_emulated
  if [ -f /tmp/mistral-2.gguf ]; then
    p=/tmp/mistral-2.lsflash
    .gpu/leanstream pack --model /tmp/mistral-2.gguf -o "$p" --down q8_0
    for how in resident streamed; do
      opts=()
      [ "$how" = streamed ] && opts=(--policy dense-stream --ffn-budget 25%)
      .gpu/leanstream run --model "$p" --prompt "The license grants" -n 16 --temp 0 --device cuda "${opts[@]}" \
        >"$out/ffn-$how.txt" 2>"$out/ffn-$how.err"
      tail -2 "$out/ffn-$how.err"
    done
    cmp "$out/ffn-resident.txt" "$out/ffn-streamed.txt" && echo "streamed FFN: the text of the resident bundles"
    .gpu/leanstream bench --model "$p" --device cuda --policy dense-stream --ffn-budget 25% \
      --prompt-tokens 16 --gen-tokens 16 --reps 2 | tee -a "$out/bench-streamed.json"
    # The CPU engine's policies on the device, with calibrated thresholds:
    # the device's text against the CPU engine's under the same policy.
    pc=/tmp/mistral-2-cal.lsflash
    .gpu/leanstream pack --model /tmp/mistral-2.gguf -o "$pc" --down q8_0 \
      --calibrate data/text/apache-2.0.txt --calib-ctx 64 --calib-tokens 128
    for policy in dense-stream gate-first; do
      for device in cpu cuda; do
        .gpu/leanstream run --model "$pc" --prompt "The license grants" -n 16 --temp 0 --device "$device" \
          --policy "$policy" --sparsity 0.5 --ffn-budget 25% \
          >"$out/policy-$policy-$device.txt" 2>"$out/policy-$policy-$device.err"
        tail -1 "$out/policy-$policy-$device.err"
      done
      cmp "$out/policy-$policy-cpu.txt" "$out/policy-$policy-cuda.txt" &&
        echo "$policy at sparsity 0.5: the device's text equals the CPU engine's"
      .gpu/leanstream bench --model "$pc" --device cuda --policy "$policy" --sparsity 0.5 --ffn-budget 25% \
        --prompt-tokens 16 --gen-tokens 16 --reps 2 | tee -a "$out/bench-policies.json"
    done
    # The predicting policies with the predictors made by `build` (the
    # device's rows round apart from the CPU's, so a ranking near a tie may
    # pick another set: the texts are compared, not required equal).
    for policy in speculate dejavu llm-in-a-flash powerinfer2; do
      pred=.gpu/mistral-2.lspred
      case $policy in dejavu | llm-in-a-flash) pred=.gpu/mistral-2.lowrank.lspred ;; esac
      [ -f "$pred" ] || continue
      for device in cpu cuda; do
        .gpu/leanstream run --model "$pc" --prompt "The license grants" -n 16 --temp 0 --device "$device" \
          --policy "$policy" --predictor "$pred" --sparsity 0.5 --ffn-budget 25% \
          >"$out/policy-$policy-$device.txt" 2>"$out/policy-$policy-$device.err"
        tail -1 "$out/policy-$policy-$device.err"
      done
      cmp "$out/policy-$policy-cpu.txt" "$out/policy-$policy-cuda.txt" &&
        echo "$policy at sparsity 0.5: the device's text equals the CPU engine's"
      .gpu/leanstream bench --model "$pc" --device cuda --policy "$policy" --predictor "$pred" --sparsity 0.5 \
        --ffn-budget 25% --prompt-tokens 16 --gen-tokens 16 --reps 2 | tee -a "$out/bench-policies.json"
    done
  fi
  [ -n "${NO_TABLE3:-}" ] || .gpu/table3 20 | tee "$out/table3.jsonl"
  ;;
stash)
  prepare
  ls -la /tmp/chunks
  ;;
models)
  prepare
  exec > >(tee "$out/gpu-models.log") 2>&1
  set +e
  mkdir -p /tmp/models
  cat /tmp/chunks/models.tar.xz.* | xz -dT0 | tar -x -C /tmp/models
  (cd /tmp/models && sha256sum -c /tmp/chunks/SHA256SUMS)
  smol=/tmp/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  gemma=/tmp/models/gemma3/gemma-3-270m-q4_k_m.gguf
  for m in "$smol" "$gemma"; do
    .gpu/greedy "$m" "The license grants" 64 | tee -a "$out/greedy.jsonl"
  done
  [ -n "${NO_BENCH:-}" ] && exit 0
  # A packed model on the device (bundles resident) against the CPU's dense
  # policy over the same file, then the device's compute profile of it.
  packed=/tmp/smollm2-q8.lsflash
  .gpu/leanstream pack --model "$smol" -o "$packed" --down q8_0
  for device in cpu cuda; do
    opts=(--device "$device")
    [ "$device" = cpu ] && opts+=(--policy dense)
    .gpu/leanstream run --model "$packed" --prompt "The license grants" -n 48 --temp 0 "${opts[@]}" \
      >"$out/packed-$device.txt" 2>"$out/packed-$device.err"
    tail -1 "$out/packed-$device.err"
  done
  cmp "$out/packed-cpu.txt" "$out/packed-cuda.txt" && echo "packed model: device text equals the CPU's"
  .gpu/leanstream-profile compute --model "$packed" --device cuda --budget "${PROFILE_S:-40}s" \
    --out /tmp/profile-cuda --quiet && .gpu/leanstream-profile summary /tmp/profile-cuda >"$out/profile-cuda.txt"
  head -40 "$out/profile-cuda.txt"
  [ -f /tmp/mistral-32.gguf ] || [ -n "${NO_7B:-}" ] || .gpu/leanstream synthetic --shape mistral-7b -o /tmp/mistral-32.gguf
  for _ in $(seq 120); do [ -d /tmp/llama ] || break; [ -f /tmp/llama/rc ] && break; sleep 5; done
  lb=()
  if [ "$(cat /tmp/llama/rc 2>/dev/null)" = 0 ]; then
    lb=(--llama-bench /tmp/llama/build/bin/llama-bench)
  elif [ -d /tmp/llama ]; then
    echo "llama.cpp's CUDA build did not finish:" && tail -30 /tmp/llama/build.log
  fi
  for m in "$smol" "$gemma" /tmp/mistral-32.gguf; do
    [ -f "$m" ] || continue
    .gpu/leanstream bench --model "$m" --device cuda --prompt-tokens 512 --gen-tokens 128 --reps 3 "${lb[@]}" |
      tee -a "$out/bench-cuda.json"
  done
  .gpu/leanstream bench --model "$packed" --device cuda --prompt-tokens 64 --gen-tokens 64 --reps 2 |
    tee -a "$out/bench-cuda.json"
  # Quality on the device (perplexity decoded there, against the CPU's dense
  # engine of the GGUF): each real model dense, then SmolLM2 packed with
  # calibrated thresholds under dense-stream and gate-first at sparsity 0.5.
  q=(--quality-file data/text/gpl-3.0-excerpt.txt --quality-chunks 4 --prompt-tokens 0 --gen-tokens 1 --reps 1)
  for m in "$smol" "$gemma"; do
    .gpu/leanstream bench --model "$m" --device cuda "${q[@]}" | tee -a "$out/quality-cuda.json"
  done
  cal=/tmp/smollm2-q8-cal.lsflash
  .gpu/leanstream pack --model "$smol" -o "$cal" --down q8_0 --calibrate data/text/apache-2.0.txt --calib-tokens 2048
  for policy in dense-stream gate-first; do
    .gpu/leanstream bench --model "$cal" --device cuda --policy "$policy" --sparsity 0.5 --ffn-budget 25% \
      --quality-reference "$smol" "${q[@]}" | tee -a "$out/quality-cuda.json"
  done
  ;;
*)
  echo "usage: scripts/gpu_check.sh build [llama]|chunks|run|stash|models" >&2
  exit 2
  ;;
esac
