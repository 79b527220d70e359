#!/usr/bin/env bash
# Builds the reference llama.cpp (the copy vendored by llama-cpp-python 0.3.36
# on PyPI) for this CPU, once, and prints its bin directory. With
# LLAMA_SERVER=1 it builds llama-server too (scripts/bench_serve.sh).
# Needs cmake and a C++ compiler; `pip install cmake ninja` provides the former.
set -euo pipefail
version=0.3.36
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
root="$home/llama-cpp-python-$version"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
targets=(llama-tokenize llama-completion llama-perplexity llama-bench)
server=OFF
if [ "${LLAMA_SERVER:-}" = 1 ]; then
  targets+=(llama-server)
  server=ON
fi

# A native build uses every instruction set /proc/cpuinfo advertises. Some VMs
# advertise AMX and llama.cpp's AMX matmuls then die on the first prompt:
# one class refuses the kernel's tile permission; another grants it, runs
# simple AMX code, and still loses llama.cpp's tile configuration between two
# matmuls (SIGILL at `tilezero` in `tinygemm_kernel_amx`). So where AMX is
# advertised, the native build must run a prompt before it is used, and
# otherwise the build without AMX is.
amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
tile_permission() {
  local probe ok=0
  probe=$(mktemp -d)
  cat >"$probe/amx.c" <<'EOF_C'
#include <sys/syscall.h>
#include <unistd.h>
/* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
int main(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 1; }
EOF_C
  { cc -O0 -o "$probe/amx" "$probe/amx.c" && "$probe/amx"; } || ok=1
  rm -rf "$probe"
  return $ok
}

# build DIR [EXTRA_FLAGS]: configures and builds the targets into DIR/bin.
build() {
  local dir=$1 flags=${2:-}
  [ -x "$dir/bin/llama-bench" ] && { [ "$server" = OFF ] || [ -x "$dir/bin/llama-server" ]; } && return
  mkdir -p "$root"
  if [ ! -d "$src" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root" >&2
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
  fi
  command -v cmake >/dev/null || python3 -m pip install cmake ninja >&2
  local generator=() arch=(-DGGML_NATIVE=ON)
  command -v ninja >/dev/null && generator=(-G Ninja)
  # GGML_NATIVE appends -march=native after CMAKE_*_FLAGS, which would turn
  # AMX back on; without AMX the same native flags come from here instead.
  [ -n "$flags" ] && arch=(-DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="-march=native $flags"
    -DCMAKE_CXX_FLAGS="-march=native $flags")
  cmake -S "$src" -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${arch[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$dir" -j"$(nproc)" --target "${targets[@]}" >&2
}

# Whether the native build in $1 runs a prompt (its verdict kept beside it):
# SmolLM2's Q4_1 matmuls take the AMX path.
runs_prompts() {
  local verdict=$1/prompt-check
  if [ ! -f "$verdict" ]; then
    local model=$home/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    # Fetched already (scripts/test.sh does): no release build of leanstream
    # just to find it.
    [ -f "$model" ] || model=$("$(dirname "$0")/fetch_models.sh" smollm2 | tail -1)
    # Braces, so that the shell's own report of a crash goes to /dev/null too.
    if { "$1/bin/llama-bench" -m "$model" -p 64 -n 1 -r 1 -t "$(nproc)" >/dev/null; } 2>/dev/null; then
      echo ok >"$verdict"
    else
      echo "exit $?" >"$verdict"
    fi
  fi
  [ "$(cat "$verdict")" = ok ]
}

bin=$src/build/bin
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  if ! tile_permission; then
    echo "llama_cpp.sh: the CPU advertises AMX but the kernel refuses tile state; building without AMX" >&2
    bin=$src/build-noamx/bin
  else
    build "$src/build"
    if ! runs_prompts "$src/build"; then
      echo "llama_cpp.sh: the native build (with AMX) dies on a prompt here ($(cat "$src/build/prompt-check")); building without AMX" >&2
      bin=$src/build-noamx/bin
    fi
  fi
fi
if [ "$bin" = "$src/build/bin" ]; then
  build "$src/build"
else
  build "$src/build-noamx" "$amx_off"
fi
echo "$bin"
