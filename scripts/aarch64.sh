#!/usr/bin/env bash
# aarch64 (Jetson, phones, ARM laptops) from an x86-64 Debian machine: the
# cross toolchain and qemu-user, the device side cross-built, its tests and
# model checks under emulation, and llama.cpp cross-built as the reference.
# On an aarch64 machine itself none of this is needed: `cargo build --release
# --bin leanstream` builds natively (docs/aarch64.md).
#
#   scripts/aarch64.sh setup          the Rust target, Debian's cross gcc and qemu-user
#   scripts/aarch64.sh build          cross-builds the leanstream binary (release); prints its path
#   scripts/aarch64.sh lint           clippy -D warnings on the crates with aarch64 code, for aarch64
#   scripts/aarch64.sh test           kernel tests under QEMU_CPU=cortex-a72 (NEON) and max
#                                     (dotprod, i8mm), then each real model against
#                                     llama.cpp's aarch64 goldens under emulation
#   scripts/aarch64.sh flash          pack, dense-stream and speculate under --mem-budget
#                                     (pread under qemu), tokens against the dense engine's
#   scripts/aarch64.sh llama ARCH     cross-builds llama.cpp for -march=ARCH (armv8-a,
#                                     armv8.2-a+dotprod); prints its bin directory
#   scripts/aarch64.sh goldens        records llama.cpp's aarch64 goldens (data/golden/aarch64/)
#   scripts/aarch64.sh count          guest instructions per decoded token, ours and llama.cpp's
#
# Env: QEMU_CPUS (default "cortex-a72 max"), CARGO_TARGET_DIR, LEANSTREAM_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$home/target}
# Set here rather than in .cargo/config.toml, which would also apply to a
# native build on an aarch64 machine.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $sysroot"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
cpus=${QEMU_CPUS:-cortex-a72 max}
llama_version=0.3.36
llama_src=$home/llama-cpp-python-$llama_version/llama_cpp_python-$llama_version/vendor/llama.cpp

setup() {
  rustup target list --installed | grep -qx $target || rustup target add $target >&2
  local missing=()
  command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
  command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
  command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
  if [ ${#missing[@]} -gt 0 ]; then
    local sudo=
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get install -y "${missing[@]}" >&2 ||
      { $sudo apt-get update >&2 && $sudo apt-get install -y "${missing[@]}" >&2; }
  fi
}

build() {
  setup
  cargo build --release --target $target --bin leanstream >&2
  echo "$CARGO_TARGET_DIR/$target/release/leanstream"
}

lint() {
  setup
  cargo clippy --target $target -p leanstream-kernels -p leanstream-runtime --all-targets -- -D warnings
}

model() { # name: the cached GGUF, fetched by the host binary when missing
  local dir file
  case $1 in
    smollm2) dir=smollm2 file=SmolLM2-135M-Instruct.Q4_1.gguf ;;
    gemma3) dir=gemma3 file=gemma-3-270m-q4_k_m.gguf ;;
  esac
  [ -f "$home/models/$dir/$file" ] || scripts/fetch_models.sh "$1" >/dev/null
  echo "$home/models/$dir/$file"
}

test_all() {
  setup
  model smollm2 >/dev/null
  model gemma3 >/dev/null
  local cpu
  for cpu in $cpus; do
    echo "== kernels under QEMU_CPU=$cpu" >&2
    QEMU_CPU=$cpu cargo test --profile ci --target $target -p leanstream-kernels
  done
  # One model-level check per real model: prompt ids, logits and greedy
  # continuations against llama.cpp built for aarch64 (scripts/aarch64.sh goldens).
  echo "== models against llama.cpp's aarch64 goldens, QEMU_CPU=cortex-a72" >&2
  QEMU_CPU=cortex-a72 cargo test --profile ci --target $target -p leanstream-runtime \
    --test golden_llama_cpp -- aarch64
}

# llama.cpp, the copy scripts/llama_cpp.sh builds for the host, cross-built
# for -march=$1 with the same cross gcc; its own run-time checks then choose
# among what that level allows.
llama() {
  local arch=${1:?usage: scripts/aarch64.sh llama ARCH}
  local dir=$home/llama-cpp-python-$llama_version/build-aarch64-$arch
  setup
  [ -d "$llama_src" ] || "$root/scripts/llama_cpp.sh" >/dev/null
  if [ ! -x "$dir/bin/llama-completion" ]; then
    local generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    cmake -S "$llama_src" -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
      -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
      -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$arch" -DGGML_OPENMP=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF >&2
    cmake --build "$dir" -j"$(nproc)" --target llama-completion llama-bench llama-tokenize >&2
  fi
  echo "$dir/bin"
}

# The golden recorder of scripts/golden/make_goldens.sh, cross-built against
# the aarch64 llama.cpp in bin directory $1.
golden_tool() {
  local bin=$1 tool=$1/golden_llama
  [ -x "$tool" ] || aarch64-linux-gnu-g++ -O2 -std=c++17 -I"$llama_src/include" \
    -I"$llama_src/ggml/include" scripts/golden/golden_llama.cpp \
    -L"$bin" -lllama -lggml -lggml-base -Wl,-rpath,"$bin" -o "$tool"
  echo "$tool"
}

goldens() {
  local bin tool out=$root/data/golden/aarch64 name path fa suffix
  bin=$(llama armv8-a)
  tool=$(golden_tool "$bin")
  mkdir -p "$out"
  local prompts=(
    "The capital of France is"
    "Once upon a time, in a small village by the sea,"
    "def fibonacci(n):"
    "The three primary colors are"
  )
  for name in smollm2 gemma3; do
    path=$(model $name)
    for fa in off on; do
      suffix=$([ $fa = on ] && echo -fa-on || true)
      echo "== $name, flash attention $fa" >&2
      QEMU_CPU=cortex-a72 qemu-aarch64 -L $sysroot "$tool" "$path" 16 --fa $fa "${prompts[@]}" \
        > "$out/generate-$name$suffix.jsonl"
    done
  done
  {
    echo "llama.cpp vendored by llama-cpp-python $llama_version, cross-built with $(aarch64-linux-gnu-gcc --version | head -1)"
    echo "-march=armv8-a (NEON, no dotprod), run under $(qemu-aarch64 --version | head -1), QEMU_CPU=cortex-a72"
    echo "command: scripts/aarch64.sh goldens"
  } > "$out/llama_cpp_version.txt"
}

# The flash path under emulation: io_uring_setup is ENOSYS under qemu-user,
# so the engine reads through its pread backend. SmolLM2 is packed by both
# engines (the files must be equal), a predictor is trained on the host, and
# each policy's greedy tokens at sparsity 0 under --mem-budget must equal the
# aarch64 dense engine's (which tests hold to llama.cpp's aarch64 bits). The
# x86 engine's tokens are printed beside them: each machine gives its own
# llama.cpp's bits, so the two may part at a near-tie.
flash() {
  local arm host work=$home/aarch64-flash m train heldout
  arm=$(build)
  cargo build --profile ci --bin leanstream --bin leanstream-profile --bin leanstream-synth >&2
  host=$CARGO_TARGET_DIR/ci
  mkdir -p "$work"
  m=$(model smollm2)
  QEMU_CPU=max qemu-aarch64 -L $sysroot "$arm" pack --model "$m" -o "$work/arm.lsflash" >&2
  "$host/leanstream" pack --model "$m" -o "$work/x86.lsflash" >&2
  cmp "$work/arm.lsflash" "$work/x86.lsflash"
  echo "pack: the aarch64 and x86 .lsflash files are identical" >&2
  if [ ! -f "$work/arm.lspred" ]; then
    read -r train heldout < <(scripts/prepare_text.sh)
    "$host/leanstream-profile" activations --model "$m" --text "$train" --heldout "$heldout" \
      -o "$work/acts" --max-tokens 768 >&2
    "$host/leanstream-synth" predictor --acts "$work/acts" -o "$work/arm.lspred" --sparsity 0.5 --quiet >/dev/null
  fi
  local gen=(--prompt "The three primary colors are" -n 16 --temp 0 --threads 2)
  local dense x86 policy out failed=0
  dense=$(QEMU_CPU=max qemu-aarch64 -L $sysroot "$arm" run --model "$m" "${gen[@]}" 2>/dev/null)
  x86=$("$host/leanstream" run --model "$m" "${gen[@]}" 2>/dev/null)
  echo "dense, aarch64: ${dense@Q}" >&2
  echo "dense, x86:     ${x86@Q}" >&2
  for policy in dense-stream speculate; do
    local args=(run --model "$work/arm.lsflash" --policy $policy --mem-budget 100MiB --ctx 256 --sparsity 0 "${gen[@]}")
    [ $policy = speculate ] && args+=(--predictor "$work/arm.lspred")
    out=$(QEMU_CPU=max qemu-aarch64 -L $sysroot "$arm" "${args[@]}" 2>"$work/$policy.log")
    grep -E "read/token" "$work/$policy.log" >&2 || true
    if [ "$out" = "$dense" ]; then
      echo "$policy under --mem-budget 100MiB (pread): the aarch64 dense engine's tokens" >&2
    else
      echo "$policy: ${out@Q} differs from the aarch64 dense engine's" >&2
      failed=1
    fi
  done
  return $failed
}

# Speed cannot be measured under emulation; the proxy is the guest
# instructions a decoded token costs, counted by a TCG plugin
# (scripts/aarch64/insn_count.c) on one thread: a run generating $hi tokens
# minus one generating $lo, over the difference, so loading and the prompt
# cancel. Ours (one binary, its kernels chosen at run time) against llama.cpp
# built for the same level: armv8-a as a Cortex-A72 (NEON), and
# armv8.2-a+dotprod as qemu's `max` CPU (dotprod, i8mm: llama.cpp then takes
# its repacked dotprod kernels). Prints JSON lines.
count() {
  local arm plugin=$home/tools/insn_count.so lo=${COUNT_LO:-4} hi=${COUNT_HI:-20}
  arm=$(build)
  mkdir -p "$home/tools"
  cc -shared -fPIC -O2 -o "$plugin" scripts/aarch64/insn_count.c
  local prompt="The three primary colors are"
  guest() { # cpu program args...: the guest instructions of one run
    local cpu=$1
    shift
    QEMU_CPU=$cpu qemu-aarch64 -L $sysroot -plugin "$plugin" -d plugin "$@" 2>&1 >/dev/null |
      sed -n 's/^guest_instructions //p'
  }
  per_token() { # cpu program args-before-n...: instructions per decoded token
    local cpu=$1 a b
    shift
    a=$(guest "$cpu" "$@" $lo)
    b=$(guest "$cpu" "$@" $hi)
    echo $(((b - a) / (hi - lo)))
  }
  local cpu arch llama_bin name m ours theirs
  for cpu in cortex-a72 max; do
    arch=$([ $cpu = max ] && echo armv8.2-a+dotprod || echo armv8-a)
    llama_bin=$(llama $arch)
    for name in smollm2 gemma3; do
      m=$(model $name)
      ours=$(per_token $cpu "$arm" run --model "$m" --threads 1 --temp 0 --ignore-eos \
        --ctx 128 --prompt "$prompt" -n)
      theirs=$(per_token $cpu "$llama_bin/llama-completion" -m "$m" -t 1 --temp 0 --ignore-eos \
        -no-cnv --no-warmup -c 128 -p "$prompt" -n)
      printf '{"model":"%s","qemu_cpu":"%s","llama_cpp_march":"%s","ours_per_token":%s,"llama_cpp_per_token":%s,"ratio":%s}\n' \
        $name $cpu $arch "$ours" "$theirs" "$(python3 -c "print(round($ours / $theirs, 3))")"
    done
  done
}

case ${1:-} in
  setup) setup ;;
  build) build ;;
  lint) lint ;;
  test) test_all ;;
  flash) flash ;;
  llama) shift; llama "$@" ;;
  goldens) goldens ;;
  count) count ;;
  *) sed -n '2,21p' "$0" >&2; exit 2 ;;
esac
