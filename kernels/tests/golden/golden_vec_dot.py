#!/usr/bin/env python3
"""Golden vec-dot results from a real llama.cpp CPU build, for the kernel tests.

Produced with (from the repository root):
    python3 kernels/tests/golden/golden_vec_dot.py \
        --lib /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/libggml-cpu.so \
        -o kernels/tests/golden/vec_dot.json

The library is the CPU backend of the llama.cpp build the project's goldens
come from (llama-cpp-python 0.3.36's vendored llama.cpp, commit 0c1e570,
`cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON`).

Calls ggml-cpu's own exported kernels through ctypes: the activation
converter of each weight type's vec-dot type (quantize_row_q8_0 / q8_1 / q8_K,
ggml_cpu_fp32_to_fp16 / bf16) and ggml_vec_dot_<w>_<a>. Weights are random
blocks with realistic scales; activations follow a formula the Rust test
repeats (see `activations` below), so only weights, converted activations
and results are stored. The test checks our quantizers reproduce the bytes
exactly and our dots the result bits (exactly for the quantized types; the
float types within rounding, since a `-march=native` build on an AVX-512
machine reduces them in 16 lanes where our AVX2 kernels use 8).
"""

import argparse
import ctypes
import json

import numpy as np

N = 512
CASES = 2

# weight type -> (vec-dot type, block size, block bytes, ggml dot symbol)
TYPES = {
    "F32": ("F32", 1, 4, "ggml_vec_dot_f32"),
    "F16": ("F16", 1, 2, "ggml_vec_dot_f16"),
    "BF16": ("BF16", 1, 2, "ggml_vec_dot_bf16"),
    "Q4_0": ("Q8_0", 32, 18, "ggml_vec_dot_q4_0_q8_0"),
    "Q4_1": ("Q8_1", 32, 20, "ggml_vec_dot_q4_1_q8_1"),
    "Q5_0": ("Q8_0", 32, 22, "ggml_vec_dot_q5_0_q8_0"),
    "Q5_1": ("Q8_1", 32, 24, "ggml_vec_dot_q5_1_q8_1"),
    "Q8_0": ("Q8_0", 32, 34, "ggml_vec_dot_q8_0_q8_0"),
    "Q4_K": ("Q8_K", 256, 144, "ggml_vec_dot_q4_K_q8_K"),
    "Q5_K": ("Q8_K", 256, 176, "ggml_vec_dot_q5_K_q8_K"),
    "Q6_K": ("Q8_K", 256, 210, "ggml_vec_dot_q6_K_q8_K"),
}
ROW_BYTES = {"F32": 4 * N, "F16": 2 * N, "BF16": 2 * N, "Q8_0": N // 32 * 34, "Q8_1": N // 32 * 36, "Q8_K": N // 256 * 292}


def activations(case):
    """Exact float32 values k/256, with each 32-block's first value 508/256 so
    the Q8 multiplier is exactly 64 and rounding ties occur (odd k/4)."""
    i = np.arange(N, dtype=np.int64)
    k = (i * 7919 + case * 104729) % 1009 - 504
    k[::32] = 508
    return (k / 256.0).astype(np.float32)


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8)


def weights(ty, rng):
    _, block, size, _ = TYPES[ty]
    nb = N // block
    if ty == "F32":
        return rng.uniform(-1, 1, N).astype(np.float32).view(np.uint8)
    if ty == "F16":
        return f16_bytes(rng.uniform(-1, 1, N))
    if ty == "BF16":
        return (rng.uniform(-1, 1, N).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    # Finite, realistic f16 scales at the offsets ggml-common.h gives them.
    scale_fields = {
        "Q4_0": [(0, 0.05)],
        "Q4_1": [(0, 0.02), (2, 0.2)],
        "Q5_0": [(0, 0.02)],
        "Q5_1": [(0, 0.01), (2, 0.2)],
        "Q8_0": [(0, 0.002)],
        "Q4_K": [(0, 0.002), (2, 0.002)],
        "Q5_K": [(0, 0.001), (2, 0.002)],
        "Q6_K": [(208, 0.0005)],
    }[ty]
    for offset, magnitude in scale_fields:
        blocks[:, offset : offset + 2] = f16_bytes(rng.uniform(-magnitude, magnitude, nb)).reshape(nb, 2)
    if ty == "Q8_0":
        q = blocks[:, 2:].view(np.int8)
        q[q == -128] = -127  # ggml's quantizer never emits -128
    return blocks.reshape(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="path to libggml-cpu.so")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()

    lib = ctypes.CDLL(args.lib)
    lib.ggml_cpu_init()
    ptr = ctypes.c_void_p

    def convert(dot_ty, x):
        out = np.zeros(ROW_BYTES[dot_ty], dtype=np.uint8)
        xp, op = x.ctypes.data_as(ptr), out.ctypes.data_as(ptr)
        if dot_ty == "F32":
            return x.view(np.uint8).copy()
        fn = {
            "F16": lib.ggml_cpu_fp32_to_fp16,
            "BF16": lib.ggml_cpu_fp32_to_bf16,
            "Q8_0": lib.quantize_row_q8_0,
            "Q8_1": lib.quantize_row_q8_1,
            "Q8_K": lib.quantize_row_q8_K,
        }[dot_ty]
        fn.argtypes = [ptr, ptr, ctypes.c_int64]
        fn(xp, op, N)
        return out

    rng = np.random.default_rng(20240607)
    records = []
    for ty, (dot_ty, _, _, symbol) in TYPES.items():
        dot = getattr(lib, symbol)
        dot.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ptr, ctypes.c_size_t, ptr, ctypes.c_size_t, ctypes.c_int]
        for case in range(CASES):
            w = np.ascontiguousarray(weights(ty, rng))
            a = np.ascontiguousarray(convert(dot_ty, activations(case)))
            result = ctypes.c_float()
            dot(N, ctypes.byref(result), 0, w.ctypes.data_as(ptr), 0, a.ctypes.data_as(ptr), 0, 1)
            bits = np.array([result.value], dtype=np.float32).view(np.uint32)[0]
            records.append(
                {
                    "type": ty,
                    "n": N,
                    "case": case,
                    "weight_hex": w.tobytes().hex(),
                    "act_hex": a.tobytes().hex(),
                    "dot_bits": f"{bits:08x}",
                    "dot": float(result.value),
                }
            )
            print(f"{ty} case {case}: {result.value!r}")
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
