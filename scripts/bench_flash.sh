#!/usr/bin/env bash
# Flash streaming on this machine, one run each: decode speed of every policy
# at one FFN budget as a ratio of `dense`, quality at several sparsities
# through the streaming engine, and dense-stream's read bandwidth against fio
# on the same file with the same request size and queue depth.
#
# Usage: scripts/bench_flash.sh [MODEL...]   (default: smollm2 gemma3)
#   MODEL is smollm2, gemma3 or a .gguf path (e.g. a `leanstream synthetic`
#   file; its quality numbers mean nothing and are not printed).
# Env: BUDGET (25%), GEN (64), REPS (2), SPARSITIES (0.5,0.7,0.8),
#      CALIB (data/text/apache-2.0.txt), EVAL (data/text/gpl-3.0-excerpt.txt),
#      OUT (folder for the JSON lines; default $LEANSTREAM_HOME/bench-flash),
#      QUALITY (1; 0 skips the perplexity runs, which do not depend on I/O),
#      PACK_ARGS (`leanstream pack` arguments beyond calibration; default --hot-first; the
#      packed file is reused while it exists, so delete it after changing them).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
budget=${BUDGET:-25%} gen=${GEN:-64} reps=${REPS:-2} sparsities=${SPARSITIES:-0.5,0.7,0.8}
calib=${CALIB:-data/text/apache-2.0.txt} eval_text=${EVAL:-data/text/gpl-3.0-excerpt.txt}
out=${OUT:-$home/bench-flash}
mkdir -p "$out" "$home/flash"
cargo build --release --bin leanstream >&2
ls=$CARGO_TARGET_DIR/release/leanstream
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2 gemma3)

for m in "${models[@]}"; do
  name=$(basename "$m" .gguf)
  flash=$home/flash/$name.lsflash
  real=0
  case $m in smollm2|gemma3) real=1 ;; esac
  if [ ! -f "$flash" ]; then
    "$ls" pack --model "$m" -o "$flash" --calibrate "$calib" --sparsities "$sparsities" ${PACK_ARGS---hot-first} >&2
  fi
  jl=$out/$name.jsonl
  : > "$jl"
  run() { # policy sparsity [extra args]
    local p=$1 s=$2; shift 2
    echo "bench $name: $p at sparsity $s, budget $budget" >&2
    "$ls" bench --model "$flash" --policy "$p" --sparsity "$s" --ffn-budget "$budget" \
      --prompt-tokens 0 --gen-tokens "$gen" --reps "$reps" "$@" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' >> "$jl"
  }
  quality=()
  [ $real = 1 ] && [ "${QUALITY:-1}" = 1 ] && quality=(--quality-file "$eval_text" --quality-ctx 256 --quality-chunks 8)
  run dense 0
  run dense-stream 0
  for s in ${sparsities//,/ }; do
    run dense-stream "$s" "${quality[@]}"
    run oracle "$s"
    run gate-first "$s" "${quality[@]}"
  done
  # fio on the same file: dense-stream's mean request size and queue depth, sequential.
  bs=$(python3 -c "
import json
r=[json.loads(l) for l in open('$jl')][1]
print(max(4096, int(r['bytes_read_per_token']/r['reads_per_token'])//4096*4096))")
  if command -v fio >/dev/null; then
    fio --name=seqread --filename="$flash" --readonly --rw=read --bs="$bs" --iodepth=16 \
      --ioengine=io_uring --direct=1 --runtime=10 --time_based --output-format=json \
      | python3 -c 'import json,sys; j=json.load(sys.stdin); print(json.dumps({"fio_read_bw_bytes_s": j["jobs"][0]["read"]["bw_bytes"], "fio_bs": '"$bs"'}))' >> "$jl"
  fi
  python3 - "$jl" "$real" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
real = sys.argv[2] == "1"
fio = next((r for r in rows if "fio_read_bw_bytes_s" in r), None)
runs = [r for r in rows if "policy" in r]
dense = runs[0]
mib = 1 << 20
print(f"\n{runs[0]['model']}  (FFN {runs[0]['ffn_total_bytes']/mib:.1f} MiB, budget {runs[1]['ffn_budget_bytes']/mib:.1f} MiB)")
print("| policy | sparsity | decode tok/s | × dense | MiB read/token | reads/token | read MB/s | cache miss | memory MiB | peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in runs:
    print(f"| {r['policy']} | {r['sparsity']:.2f} | {r['decode_tok_s']:.2f} | {r['decode_tok_s']/dense['decode_tok_s']:.3f} | "
          f"{r['bytes_read_per_token']/mib:.1f} | {r['reads_per_token']:.0f} | {r['read_bw_bytes_s']/1e6:.0f} | "
          f"{r['cache_miss_ratio']:.3f} | {r['memory']['total']/mib:.1f} | {r['peak_rss_bytes']/mib:.1f} |")
if fio:
    ds = runs[1]
    print(f"\ndense-stream read bandwidth {ds['read_bw_bytes_s']/1e6:.0f} MB/s vs fio (seq, bs {fio['fio_bs']//1024} KiB, QD16, io_uring, direct) "
          f"{fio['fio_read_bw_bytes_s']/1e6:.0f} MB/s: ratio {ds['read_bw_bytes_s']/fio['fio_read_bw_bytes_s']:.3f}")
q = [r for r in runs if "quality" in r]
if real and q:
    print("\n| policy (criterion) | sparsity | skipped | ppl | ppl dense | ppl ratio | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for r in q:
        k = r["quality"]
        crit = "on act(g)" if r["policy"] == "gate-first" else "on act(g)·u"
        print(f"| {r['policy']} ({crit}) | {r['sparsity']:.2f} | {k['skipped_fraction']:.3f} | {k['ppl']:.3f} | {k['ppl_dense']:.3f} | {k['ppl_ratio']:.3f} | {k['top1_agreement']:.3f} |")
PY
done
