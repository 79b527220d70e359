#!/usr/bin/env bash
# Does the controller table earn its place in the real engine? `speculate`
# with the table against every action of the table's codebook pinned for
# every layer (`--controller fixed:...`), on the same file, budget and
# sparsity, repetitions interleaved (the machine drifts). Each run is scored
# by the control model's own per-token cost, measured in the engine:
#   token time [µs] + w_skip · n_layers · late share + w_waste · wasted MiB
# where the late share is the deadline-skipped bundles over the bundles a
# token needed (hits and misses), wasted MiB are bytes read beyond the
# bundles asked for, and w_skip, w_waste, n_layers are the table's own
# solver settings. Prints the table's cost and rank among the fixed actions,
# the best fixed action by cost and by speed, and writes every run as JSON
# lines.
#
# Usage: scripts/sweep_codebook.sh FLASH [TABLE]   (default TABLE: the one
#        `leanstream run` would use: beside the model, else data/controller/)
# Env: BUDGET (25%), SPARSITY (0.5), GEN (32), REPS (2), OUT (JSON lines;
#      default $LEANSTREAM_HOME/sweep-codebook/<stem>.jsonl).
# Needs the predictor beside the model (scripts/bench_speculate.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
flash=$1
stem=$(basename "$flash" .lsflash)
table=${2:-}
if [ -z "$table" ]; then
  for t in "${flash%.lsflash}.lstab" "$(dirname "$flash")/controller.lstab" data/controller/controller.lstab; do
    [ -f "$t" ] && { table=$t; break; }
  done
fi
budget=${BUDGET:-25%} sparsity=${SPARSITY:-0.5} gen=${GEN:-32} reps=${REPS:-2}
out=${OUT:-$home/sweep-codebook/$stem.jsonl}
mkdir -p "$(dirname "$out")"
cargo build --release --bin leanstream --bin leanstream-synth >&2
bin=$CARGO_TARGET_DIR/release
settings=$("$bin/leanstream-synth" inspect "$table" --svg /dev/null | sed -n 's/^solver settings: //p')
: > "$out"
python3 - "$bin/leanstream" "$flash" "$table" "$settings" "$budget" "$sparsity" "$gen" "$reps" "$out" <<'PY'
import itertools, json, subprocess, sys

exe, flash, table, settings, budget, sparsity, gen, reps, out = sys.argv[1:]
settings = json.loads(settings)
acts, model = settings["actions"], settings["model"]
fixed = [
    f"fixed:K={k},b={b},d={d},q={q}"
    for k, q, b, d in itertools.product(
        acts["stages"], acts["queue_depths"], acts["prefetch_breadths"], acts["deadline_factors"]
    )
]
controllers = [table] + fixed
n_layers, w_skip, w_waste = model["n_layers"], model["w_skip_us"], model["w_waste_us_per_mib"]
bundle = model["bundle_bytes"]


def run(controller):
    cmd = [exe, "bench", "--model", flash, "--policy", "speculate", "--controller", controller,
           "--ffn-budget", budget, "--sparsity", sparsity, "--prompt-tokens", "0",
           "--gen-tokens", gen, "--reps", "1"]
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    sp = r["speculate"]
    misses = r["bytes_requested_per_token"] / bundle
    needed = misses / r["cache_miss_ratio"] if r["cache_miss_ratio"] > 0 else misses
    late_share = sp["late_skipped_per_token"] / needed if needed > 0 else 0.0
    wasted_mib = max(r["bytes_read_per_token"] - r["bytes_requested_per_token"], 0.0) / 2**20
    token_us = 1e6 / r["decode_tok_s"]
    return {
        "controller": controller,
        "decode_tok_s": r["decode_tok_s"],
        "late_share": late_share,
        "wasted_mib_per_token": wasted_mib,
        "skipped_fraction": r["skipped_fraction"],
        "cost_us": token_us + w_skip * n_layers * late_share + w_waste * wasted_mib,
        "actions": [a["code"] for a in sp["actions"]],
    }


rows = {c: [] for c in controllers}
with open(out, "a") as f:
    for rep in range(int(reps)):
        for i, c in enumerate(controllers):
            row = run(c)
            rows[c].append(row)
            f.write(json.dumps({"rep": rep, **row}) + "\n")
            print(f"rep {rep} {i + 1}/{len(controllers)} {c}: {row['decode_tok_s']:.2f} tok/s, "
                  f"late {row['late_share']:.3f}, cost {row['cost_us']:.0f} µs", file=sys.stderr)


def mean(c, k):
    return sum(r[k] for r in rows[c]) / len(rows[c])


by_cost = sorted(fixed, key=lambda c: mean(c, "cost_us"))
by_speed = sorted(fixed, key=lambda c: -mean(c, "decode_tok_s"))
rank = 1 + sum(mean(c, "cost_us") < mean(table, "cost_us") for c in fixed)
print(f"\n{flash}: speculate, {budget} cache, sparsity {sparsity}, {gen} tokens x {reps} interleaved reps")
print(f"cost per token = time + {w_skip:g} µs x {n_layers} layers x late share + {w_waste:g} µs/MiB x wasted MiB")
print("| controller | decode tok/s | late share | wasted MiB/token | cost µs/token |")
print("|---|---|---|---|---|")
for c in [table] + by_cost[:5] + [by_speed[0]]:
    print(f"| {c} | {mean(c, 'decode_tok_s'):.2f} | {mean(c, 'late_share'):.3f} | "
          f"{mean(c, 'wasted_mib_per_token'):.2f} | {mean(c, 'cost_us'):.0f} |")
print(f"the table ranks {rank} of {len(fixed) + 1} by cost; best fixed by cost: {by_cost[0]}, "
      f"by speed: {by_speed[0]}; table / best fixed cost = {mean(table, 'cost_us') / mean(by_cost[0], 'cost_us'):.3f}")
PY
