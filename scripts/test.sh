#!/usr/bin/env bash
# Fetches the two reference models into the cache (once), then runs every test.
# A test that needs a missing model fails; on an offline machine set
# LEANSTREAM_ALLOW_MISSING_MODELS=1 to have those tests skip (SKIPPED lines).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
# The `ci` profile (Cargo.toml): release optimisation without LTO. The test
# build makes the leanstream binary too, with the features the whole
# workspace unifies, so the run below compiles nothing again.
cargo test --profile ci --workspace --no-run
for m in smollm2 gemma3; do
  if ! "$CARGO_TARGET_DIR/ci/leanstream" fetch "$m"; then
    [ "${LEANSTREAM_ALLOW_MISSING_MODELS:-}" = 1 ] || { echo "error: could not fetch $m (set LEANSTREAM_ALLOW_MISSING_MODELS=1 to skip its tests)" >&2; exit 1; }
    echo "warning: could not fetch $m; its tests will be skipped" >&2
  fi
done
# The GPU backend's tests compile every CUDA kernel with NVRTC, which runs on
# the CPU; NVIDIA's wheel provides the library without a driver or toolkit.
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
if [ ! -f "$home/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] &&
  ! python3 -m pip install --quiet --no-deps --target "$home/nvrtc" nvidia-cuda-nvrtc-cu12==12.9.86; then
  [ "${LEANSTREAM_ALLOW_MISSING_MODELS:-}" = 1 ] || { echo "error: could not install NVRTC (set LEANSTREAM_ALLOW_MISSING_MODELS=1 to skip the tests that need it)" >&2; exit 1; }
fi
# The server's tests drive it with the official `openai` Python client.
if ! python3 -c "import openai" 2>/dev/null && ! python3 -m pip install --quiet openai; then
  [ "${LEANSTREAM_ALLOW_MISSING_MODELS:-}" = 1 ] || { echo "error: could not install the openai Python package (set LEANSTREAM_ALLOW_MISSING_MODELS=1 to skip the test that needs it)" >&2; exit 1; }
fi
cargo test --profile ci --workspace --no-fail-fast "$@"
# The aarch64 side under emulation (kernels as a Cortex-A72 and with dotprod,
# each real model against llama.cpp's aarch64 goldens) where the cross
# toolchain and qemu-user are installed (`scripts/aarch64.sh setup`; CI does).
if command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null &&
  rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu; then
  scripts/aarch64.sh test
else
  echo "note: aarch64 checks skipped (no cross toolchain or qemu-user; scripts/aarch64.sh setup installs them)" >&2
fi
