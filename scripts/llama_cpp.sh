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
# advertise AMX without enabling its tile state, and AMX code then dies with an
# invalid opcode on the first prompt: ask the kernel for tile permission (as
# any AMX program must) and build without AMX when it refuses.
amx_flags=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  probe=$(mktemp -d)
  cat >"$probe/amx.c" <<'EOF_C'
#include <sys/syscall.h>
#include <unistd.h>
/* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
int main(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 1; }
EOF_C
  if ! { cc -O0 -o "$probe/amx" "$probe/amx.c" && "$probe/amx"; }; then
    amx_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "llama_cpp.sh: the CPU advertises AMX but the kernel refuses tile state; building without AMX" >&2
  fi
  rm -rf "$probe"
fi
build="$src/build${amx_flags:+-noamx}"
bin="$build/bin"
if [ ! -x "$bin/llama-bench" ] || { [ "$server" = ON ] && [ ! -x "$bin/llama-server" ]; }; then
  mkdir -p "$root"
  if [ ! -d "$src" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root" >&2
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
  fi
  command -v cmake >/dev/null || python3 -m pip install cmake ninja >&2
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  # GGML_NATIVE appends -march=native after CMAKE_*_FLAGS, which would turn
  # AMX back on; without AMX the same native flags come from here instead.
  arch=(-DGGML_NATIVE=ON)
  [ -n "$amx_flags" ] && arch=(-DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="-march=native $amx_flags"
    -DCMAKE_CXX_FLAGS="-march=native $amx_flags")
  cmake -S "$src" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${arch[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >&2
fi
echo "$bin"
