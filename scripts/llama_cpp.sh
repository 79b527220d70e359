#!/usr/bin/env bash
# Builds the reference llama.cpp (the copy vendored by llama-cpp-python 0.3.36
# on PyPI) for this CPU, once, and prints its bin directory.
# Needs cmake and a C++ compiler; `pip install cmake ninja` provides the former.
set -euo pipefail
version=0.3.36
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
root="$home/llama-cpp-python-$version"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
bin="$src/build/bin"
targets=(llama-tokenize llama-completion llama-perplexity llama-bench)
if [ ! -x "$bin/llama-bench" ]; then
  mkdir -p "$root"
  if [ ! -d "$src" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root" >&2
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
  fi
  command -v cmake >/dev/null || python3 -m pip install cmake ninja >&2
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$src" -B "$src/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$src/build" -j"$(nproc)" --target "${targets[@]}" >&2
fi
echo "$bin"
