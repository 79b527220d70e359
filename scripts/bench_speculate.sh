#!/usr/bin/env bash
# speculate against the other policies, the prior systems' among them
# (dejavu, llm-in-a-flash, powerinfer2), in one run per model: the same
# .lsflash file, FFN budget and sparsity; decode tokens/s, bytes read per
# token, skipped share, held-out perplexity (scored token by token for the
# predicting policies, whose choice for a batch is a union over its rows) and
# the controller's action histogram; then the speed-quality curve over the
# deadline factor, Table 4 (the cache's held-out miss ratio by eviction
# policy) and, with SWEEP=1, Figure 8 (bench --sweep over budgets).
#
# Usage: scripts/bench_speculate.sh [MODEL...]   (default: smollm2 gemma3)
# Env: BUDGET (25%), SPARSITY (0.5), GEN (64), REPS (2), QCHUNKS (4 chunks of
#      256 for perplexity), TOKENS (12288 training tokens for the predictor),
#      DEADLINES (1,2,4,8,32,inf), OUT (default $LEANSTREAM_HOME/bench-speculate).
# Artifacts land beside the packed file ($LEANSTREAM_HOME/flash/NAME.lsflash,
# NAME.lspred, NAME.lowrank.lspred, NAME.lsevict), where `leanstream run`
# finds them.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
budget=${BUDGET:-25%} sparsity=${SPARSITY:-0.5} gen=${GEN:-64} reps=${REPS:-2} qchunks=${QCHUNKS:-4}
out=${OUT:-$home/bench-speculate}
cargo build --release --bin leanstream --bin leanstream-profile --bin leanstream-synth >&2
bin=$CARGO_TARGET_DIR/release
read -r train heldout < <(scripts/prepare_text.sh)
mkdir -p "$out" "$home/flash"
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2 gemma3)

for m in "${models[@]}"; do
  name=$(basename "$m" .gguf)
  flash=$home/flash/$name.lsflash
  [ -f "$flash" ] || "$bin/leanstream" pack --model "$m" -o "$flash" --calibrate data/text/apache-2.0.txt \
    --sparsities 0.5,0.7,0.8 --hot-first >&2
  pred=$home/flash/$name.lspred
  if [ ! -f "$pred" ]; then
    # Same command again continues an interrupted recording.
    "$bin/leanstream-profile" activations --model "$m" --text "$train" --heldout "$heldout" \
      -o "$home/acts/$name" --max-tokens "${TOKENS:-12288}" >&2
    "$bin/leanstream-synth" predictor --acts "$home/acts/$name" -o "$pred" --sparsity "$sparsity" \
      --baseline "$home/flash/$name.lowrank.lspred" --quiet > "$out/$name-train.json"
  fi
  # Table 4, and the retention table the learned cache policy reads.
  "$bin/leanstream-synth" eviction --acts "$home/acts/$name" -o "$home/flash/$name.lsevict" \
    --sparsity "$sparsity" --json > "$out/$name-table4.json"
  jl=$out/$name.jsonl
  : > "$jl"
  run() { # label policy [extra args]
    local label=$1 p=$2; shift 2
    echo "bench $name: $label" >&2
    "$bin/leanstream" bench --model "$flash" --policy "$p" --sparsity "$sparsity" --ffn-budget "$budget" \
      --prompt-tokens 0 --gen-tokens "$gen" --reps "$reps" \
      --quality-file "$heldout" --quality-ctx 256 --quality-chunks "$qchunks" "$@" |
      python3 -c 'import json,sys; r=json.load(sys.stdin); r["label"]=sys.argv[1]; print(json.dumps(r))' "$label" >> "$jl"
  }
  run dense-stream dense-stream
  run oracle oracle
  run gate-first gate-first
  run "speculate (table)" speculate
  run "speculate K=1 b=1 d=inf" speculate --controller fixed:K=1,b=1,d=inf,q=16
  run "speculate K=2 b=1.5 d=inf" speculate --controller fixed:K=2,b=1.5,d=inf,q=16
  run "speculate low-rank K=2 b=1.5 d=inf" speculate --predictor "$home/flash/$name.lowrank.lspred" \
    --controller fixed:K=2,b=1.5,d=inf,q=16
  run "speculate K=2 b=1.5 d=inf, hot cache" speculate --controller fixed:K=2,b=1.5,d=inf,q=16 --cache-policy hot
  # The prior systems, each with its own predictor kind and cache (defaults).
  run dejavu dejavu
  run llm-in-a-flash llm-in-a-flash
  run powerinfer2 powerinfer2
  dl=${DEADLINES:-1,2,4,8,32,inf}
  for d in ${dl//,/ }; do
    run "speculate K=2 b=1.5 d=$d" speculate --controller "fixed:K=2,b=1.5,d=$d,q=16"
  done
  if [ "${SWEEP:-0}" = 1 ]; then
    "$bin/leanstream" bench --model "$flash" --sweep --out "$out/$name-sweep" --sparsity "$sparsity" \
      --prompt-tokens 0 --gen-tokens "$gen" --reps "$reps" > /dev/null
  fi
  python3 - "$jl" "$out/$name-table4.json" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
baselines = ("dense-stream", "gate-first", "dejavu", "llm-in-a-flash", "powerinfer2")
base = max((r for r in rows if r["policy"] in baselines), key=lambda r: r["decode_tok_s"])
print(f"{rows[0]['model']}: budget {rows[0]['ffn_budget_bytes']/2**20:.1f} MiB of {rows[0]['ffn_total_bytes']/2**20:.1f} MiB FFN, sparsity {rows[0]['sparsity']}; ratios to {base['label']}")
print("| run | cache | decode tok/s | ratio | MiB read/token | skipped | late bundles/token | ppl ratio | top-1 |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    q = r.get("quality", {})
    s = r.get("speculate", {})
    late = s.get("late_skipped_bundles", 0) / max(1, r["gen_tokens"] * (r["reps"] + 1))
    print(f"| {r['label']} | {r['cache_policy']} | {r['decode_tok_s']:.1f} | {r['decode_tok_s']/base['decode_tok_s']:.2f} | "
          f"{r['bytes_read_per_token']/2**20:.1f} | {r['skipped_fraction']:.3f} | {late:.0f} | "
          f"{q.get('ppl_ratio', float('nan')):.3f} | {q.get('top1_agreement', float('nan')):.3f} |")
t = next(r for r in rows if r["label"] == "speculate (table)")["speculate"]
print("table actions (K, q, b, d: layers):", ", ".join(
    f"({a['stages']},{a['queue_depth']},{a['prefetch_breadth']},{a['deadline_factor']}): {a['layers']}" for a in t["actions"]))
t4 = json.load(open(sys.argv[2]))
lru = t4["rows"][0]["miss_ratio"]
print(f"Table 4: held-out miss ratio, cache {t4['budget_share']*100:.0f}% of neurons, sparsity {t4['sparsity']}")
print("| eviction | miss ratio | vs LRU |")
print("|---|---|---|")
for r in t4["rows"]:
    print(f"| {r['policy']} | {r['miss_ratio']:.4f} | {r['miss_ratio']/lru:.2f}x |")
EOF
done
