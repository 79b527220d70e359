#!/usr/bin/env bash
# Profiling cost: a long uniform profile against a short adaptive one (1/45
# of its time, `leanstream-synth adaptive-profile`) and a short uniform one
# (the same short time), each synthesized into a controller table for the
# same packed model with the same settings. The tables are compared by
# simulated cost on the long profile's held-out half (odd rounds, which no
# table was fitted on... except that the long table saw the even rounds of
# the same run) and in the real engine: decode tokens/s and skipped share
# of `speculate` driven by each table, interleaved.
#
# Usage: scripts/bench_adaptive_profile.sh FLASH [LONG_SECONDS]
#   FLASH: a packed model with its predictor beside it (e.g. a tune's model.lsflash)
# Env: OUT (default $LEANSTREAM_HOME/adaptive-vs-uniform), W_SKIP_US (100000),
#      REPS (2 engine rounds), PROFILE (release),
#      SIM_TOKENS (2000: at the simulator's default 40, one table's cost varied by
#      up to 8% between seeds, more than the differences it must show; at 2000, 0.6%),
#      SHORT_SECONDS (LONG_SECONDS / 45), SHORT_REPS (1): independent short adaptive and short uniform profiles each,
#      so the adaptive-against-uniform difference can be told from run-to-run noise
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
flash=$(realpath "$1")
long=${2:-7200}
short=${SHORT_SECONDS:-$(python3 -c "print(round($long / 45, 1))")}
out=${OUT:-$home/adaptive-vs-uniform}
profile=${PROFILE:-release}
cargo build --profile "$profile" --bin leanstream --bin leanstream-profile --bin leanstream-synth >&2
bin=$CARGO_TARGET_DIR/$profile
rm -rf "$out"
mkdir -p "$out/scratch"
model_args=(--flash "$flash" --w-skip-us "${W_SKIP_US:-100000}" --scenarios 24)
uniform() { # DIR SECONDS: the tune's grids, every condition sampled in turn until the time is spent
  local half
  half=$(python3 -c "print($2 / 2)")
  "$bin/leanstream-profile" --quiet io --dir "$out/scratch" --file-size 1g --block-sizes 4k,64k,256k \
    --queue-depths 1,4,16 --workers 1 --patterns random --engines io_uring --reps 1000000000000 \
    --budget "${half}s" --out "$1/io" >&2
  "$bin/leanstream-profile" --quiet compute --model "$flash" --stages 1,2,4,8 --ctx 256 --threads "$(nproc)" \
    --background-io off --reps 1000000000000 --budget "${half}s" --out "$1/compute" >&2
}
t0=$(date +%s.%N)
uniform "$out/long" "$long"
t1=$(date +%s.%N)
short_reps=${SHORT_REPS:-1}
tables=(long)
adaptive_s=0
uniform_s=0
for r in $(seq "$short_reps"); do
  a0=$(date +%s.%N)
  "$bin/leanstream-synth" adaptive-profile "${model_args[@]}" --io-dir "$out/scratch" --file-size 1g \
    --budget "${short}s" --out "$out/adaptive-$r" > "$out/adaptive-$r-rounds.json"
  a1=$(date +%s.%N)
  uniform "$out/short-uniform-$r" "$short"
  a2=$(date +%s.%N)
  adaptive_s=$(python3 -c "print($adaptive_s + $a1 - $a0)")
  uniform_s=$(python3 -c "print($uniform_s + $a2 - $a1)")
  tables+=("adaptive-$r" "short-uniform-$r")
done
python3 -c "import json; json.dump({'long_s': $t1 - $t0, 'adaptive_s': $adaptive_s / $short_reps, 'short_uniform_s': $uniform_s / $short_reps, 'short_reps': $short_reps}, open('$out/times.json', 'w'))"
for t in "${tables[@]}"; do
  "$bin/leanstream-synth" controller --traces "$out/$t" "${model_args[@]}" -o "$out/$t.lstab" --quiet >&2
  "$bin/leanstream-synth" simulate --table "$out/$t.lstab" --traces "$out/long" "${model_args[@]}" --no-mpc \
    --tokens "${SIM_TOKENS:-2000}" --json > "$out/$t-sim.json"
done
for rep in $(seq "${REPS:-2}"); do
  for t in "${tables[@]}"; do
    "$bin/leanstream" bench --model "$flash" --policy speculate --controller "$out/$t.lstab" --sparsity 0.5 \
      --ffn-budget 25% --prompt-tokens 0 --gen-tokens 32 --reps 2 > "$out/$t-bench-$rep.json"
  done
done
python3 - "$out" "${tables[@]}" <<'EOF2'
import json, sys, glob
out, tables = sys.argv[1], sys.argv[2:]
times = json.load(open(f"{out}/times.json"))
print(f"wall: long uniform {times['long_s']:.0f} s, short adaptive {times['adaptive_s']:.1f} s "
      f"({times['long_s'] / times['adaptive_s']:.1f}x less), short uniform {times['short_uniform_s']:.1f} s "
      f"(means over {times['short_reps']} runs each)")
sims = {t: {r["policy"]: r for r in json.load(open(f"{out}/{t}-sim.json"))} for t in tables}
base = sims["long"]["table"]["mean_cost"]
print("| table | simulated cost (long's held-out) | vs long | skipped mass | decode tok/s (runs) | skipped share |")
print("|---|---|---|---|---|---|")
for t in tables:
    s = sims[t]["table"]
    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{t}-bench-*.json"))]
    tps = [r["decode_tok_s"] for r in runs]
    skip = sum(r["skipped_fraction"] for r in runs) / len(runs)
    print(f"| {t} | {s['mean_cost']:.1f} | {s['mean_cost'] / base:.4f} | {s['skipped_mass']:.4f} | "
          f"{sum(tps) / len(tps):.1f} ({', '.join(f'{x:.1f}' for x in tps)}) | {skip:.3f} |")
for kind in ("adaptive", "short-uniform"):
    ratios = [sims[t]["table"]["mean_cost"] / base for t in tables if t.rsplit("-", 1)[0] == kind]
    mean = sum(ratios) / len(ratios)
    print(f"{kind}: cost vs long, mean {mean:.4f}, worst {max(ratios):.4f} over {len(ratios)} runs")
fixed = sims["long"]
best = min((r for k, r in fixed.items() if k.startswith("best_fixed")), key=lambda r: r["mean_cost"])
print(f"best fixed action on the same held-out half: {best['policy']} {best['mean_cost']:.1f}")
EOF2
