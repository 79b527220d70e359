#!/usr/bin/env bash
# The flash engine against its two bounds, one model at a time, in one run:
#  1. `dense` over the .lsflash file against the GGUF engine on the same
#     model (prompt and decode tokens/s, repetitions interleaved);
#  2. `dense-stream` at an FFN budget against the lower of (a) `dense`
#     compute speed and (b) fio's sequential-read bandwidth (dense-stream
#     reads each layer front to back) at the request size the engine issues
#     (same file, O_DIRECT, io_uring, QD16) divided by the bytes it reads per
#     decoded token, measured right before and right after each dense-stream
#     run (their mean: the virtual disk changes speed within seconds);
#  3. the engine's time split per token (compute, waiting on reads, overlap).
#
# Usage: scripts/bench_engine.sh [MODEL...]   (default: smollm2 gemma3)
#   MODEL is smollm2, gemma3 or a .gguf path (e.g. `leanstream synthetic`).
# Env: BUDGET (25%), PROMPT (128), GEN (128), REPS (3), FIO_SECONDS (4), OUT (JSON lines;
#      default $LEANSTREAM_HOME/bench-engine), PACK_ARGS (default --down source:
#      the down matrices in the model's own blocks, exact at sparsity 0; the
#      packed file is reused while it exists, so delete it after changing them),
#      PROFILE (release; `ci` reuses scripts/test.sh's build, whose binary has
#      the whole workspace's features: every ratio compares engines inside one binary).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
budget=${BUDGET:-25%} prompt=${PROMPT:-128} gen=${GEN:-128} reps=${REPS:-3}
out=${OUT:-$home/bench-engine}
mkdir -p "$out" "$home/flash"
ls=$(scripts/leanstream_bin.sh)
command -v fio >/dev/null || { apt-get update >&2 && apt-get install -y fio >&2; }
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2 gemma3)

for m in "${models[@]}"; do
  gguf=$("$ls" fetch "$m" 2>/dev/null || echo "$m")
  name=$(basename "$gguf" .gguf)
  flash=$home/flash/$name.engine3.lsflash
  if [ ! -f "$flash" ]; then
    args=${PACK_ARGS---down source}
    # shellcheck disable=SC2086
    "$ls" pack --model "$gguf" -o "$flash" $args >&2
  fi
  jl=$out/$name.jsonl
  : > "$jl"
  bench() { # label model [args]
    local label=$1 model=$2; shift 2
    echo "bench $name: $label" >&2
    "$ls" bench --model "$model" --prompt-tokens "${P:-$prompt}" --gen-tokens "$gen" --reps 1 "$@" 2>/dev/null |
      python3 -c 'import json,sys; r=json.load(sys.stdin); r["label"]=sys.argv[1]; print(json.dumps(r))' "$label" >> "$jl"
  }
  # fio at the mean request size the last dense-stream run issued, in its
  # order (a layer is read front to back), at its queue depth.
  fio_bound() {
    local bs
    bs=$(python3 - "$jl" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"dense-stream"' in l][-1]
print(max(4096, int(r["bytes_read_per_token"] / r["reads_per_token"]) // 4096 * 4096))
PY
)
    fio --name=engine-size --filename="$flash" --readonly --rw=read --bs="$bs" --iodepth=16 \
      --ioengine=io_uring --direct=1 --runtime="${FIO_SECONDS:-4}" --time_based --output-format=json |
      python3 -c 'import json,sys; j=json.load(sys.stdin); print(json.dumps({"label": "fio", "bw": j["jobs"][0]["read"]["bw_bytes"], "bs": int(sys.argv[1])}))' "$bs" >> "$jl"
  }
  # Interleaved repetitions: the machine is shared and its speed drifts (the
  # virtual disk's by 2x from one minute to the next), so each dense-stream
  # run sits between two fio measurements and ratios are taken per repetition.
  # A short first run tells fio the request size the engine issues.
  P=0 gen=8 bench warmup "$flash" --policy dense-stream --ffn-budget "$budget"
  for _ in $(seq "$reps"); do
    bench gguf "$gguf"
    bench dense "$flash" --policy dense
    fio_bound
    # Decode only: a prompt batch shares each layer's reads across its rows,
    # which would hide the bytes a decoded token costs.
    P=0 bench dense-stream "$flash" --policy dense-stream --ffn-budget "$budget"
    fio_bound
  done
  python3 - "$jl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["label"], []).append(r)
med = lambda label, key: statistics.median(r[key] for r in by[label])
g_pp, g_tg = med("gguf", "prompt_tok_s"), med("gguf", "decode_tok_s")
d_pp, d_tg = med("dense", "prompt_tok_s"), med("dense", "decode_tok_s")
# Per repetition: dense-stream against the lower of that repetition's two
# bounds, fio's the mean of the measurements before and after the run.
per_rep = []
fio = [{**a, "bw": (a["bw"] + b["bw"]) / 2} for a, b in zip(by["fio"][0::2], by["fio"][1::2])]
for d, s, f in zip(by["dense"], by["dense-stream"], fio):
    io_bound = f["bw"] / s["bytes_read_per_token"] if s["bytes_read_per_token"] > 0 else float("inf")
    per_rep.append((s["decode_tok_s"], d["decode_tok_s"], io_bound, f))
s_tg = statistics.median(p[0] for p in per_rep)
io_bound = statistics.median(p[2] for p in per_rep)
ratio = statistics.median(p[0] / min(p[1], p[2]) for p in per_rep)
ds = by["dense-stream"][-1]
mib = 1 << 20
print(f"\n{rows[0]['model']}  (medians of {len(by['gguf'])} interleaved runs)")
print(f"GGUF engine: prompt {g_pp:.1f} tok/s, decode {g_tg:.2f} tok/s")
print(f"dense .lsflash: prompt {d_pp:.1f} ({d_pp/g_pp:.3f}x), decode {d_tg:.2f} ({d_tg/g_tg:.3f}x)")
print(f"  paired per run: prompt {statistics.median(d['prompt_tok_s'] / g['prompt_tok_s'] for d, g in zip(by['dense'], by['gguf'])):.3f}x, "
      f"decode {statistics.median(d['decode_tok_s'] / g['decode_tok_s'] for d, g in zip(by['dense'], by['gguf'])):.3f}x")
print(f"dense-stream at {ds['ffn_budget_bytes']/mib:.1f} MiB cache: decode {s_tg:.2f} tok/s; "
      f"{ds['bytes_read_per_token']/mib:.2f} MiB read/token, {ds['reads_per_token']:.1f} reads/token")
print(f"  bounds: (a) dense compute {d_tg:.2f} tok/s, (b) fio {statistics.median(p[3]['bw'] for p in per_rep)/1e6:.0f} MB/s "
      f"at {per_rep[-1][3]['bs']//1024} KiB / bytes per token = {io_bound:.2f} tok/s -> {ratio:.3f}x of the lower "
      f"(median of per-run ratios: {', '.join(f'{p[0] / min(p[1], p[2]):.2f}' for p in per_rep)})")
t = ds["time_per_token"]
print(f"  per token (last run): ffn {t['ffn_s']*1e3:.2f} ms = compute {t['compute_s']*1e3:.2f} + waiting on reads "
      f"{t['io_wait_s']*1e3:.2f}; I/O busy {t['io_busy_s']*1e3:.2f}, overlapped with compute {t['overlap_s']*1e3:.2f}")
engine_bw = ", ".join(f"{r['read_bw_bytes_s'] / 1e6:.0f}" for r in by["dense-stream"])
fio_bw = ", ".join(f"{a['bw'] / 1e6:.0f}/{b['bw'] / 1e6:.0f}" for a, b in zip(by["fio"][0::2], by["fio"][1::2]))
depth = ", ".join(f"{r.get('io_mean_depth', 0):.1f}" for r in by["dense-stream"])
print(f"  read speed per run (MB/s): engine {engine_bw}; fio before/after {fio_bw}; reads in flight {depth}")
PY
done
