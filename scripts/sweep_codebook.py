#!/usr/bin/env python3
"""Does the controller table earn its place in the real engine?

`speculate` with the table against every action of the table's codebook
pinned for every layer (`--controller fixed:...`), on the same file, budget
and sparsity, repetitions interleaved (the machine drifts). Run by
`scripts/sweep_codebook.sh`, which builds the binaries and finds the table;
the settings come as environment variables (see there).

Each run is scored by the control model's own per-token cost, measured in
the engine:

    token time [µs] + w_skip · Σ_layers skipped mass + w_waste · wasted MiB

A layer's skipped mass is 1 − recall(b) · (1 − late share), as in the model
(`synth/src/model.rs`, `step`). recall(b) is the share of the true active
mass the engine computes at prefetch breadth b without a deadline, measured
by the engine's audit (`bench --quality-file`'s `skipped_mass`) on
QUALITY_TEXT, one run per breadth; without a text, the table's own
`recall_by_breadth` (the predictor's offline recall of the top b × need,
which misses what merged reads and the cache add). The late share is the
deadline-skipped bundles over the bundles a token needed. Wasted MiB are
bytes read beyond the bundles asked for; w_skip, w_waste and n_layers are
the table's solver settings. Scored on time and lateness alone, narrow
actions look cheap because they compute less: on Gemma 3, fixed K=4, b=1,
d=32, q=4 then "beat" the table by 13% at a held-out perplexity of 1.39x
dense against 1.06x at b=2.5.

A rank from a sweep is biased against the table: runs of one setting
spread by about 10% here, so the cheapest of 81 noisy fixed actions looks
cheaper than it is. The confirmation therefore runs the table against the
sweep's best CONFIRM_TOP fixed actions (and CONFIRM_ALSO tables, e.g. one
made for another device) again, in CONFIRM_REPS rounds of fresh shuffled
order, and reports each one's paired per-round cost ratio to the best
confirmed fixed action (geometric mean, 95% bootstrap interval over the
rounds); with
QUALITY_TEXT each contender also gets one audited quality run (perplexity
and top-1 against the packed file's dense run, skipped mass).
"""

import itertools
import json
import math
import os
import random
import subprocess
import sys


def env(name, default):
    return os.environ.get(name) or default


exe, flash, table, settings_json = sys.argv[1:5]
settings = json.loads(settings_json)
budget, sparsity = env("BUDGET", "25%"), env("SPARSITY", "0.5")
gen, reps = env("GEN", "32"), int(env("REPS", "2"))
out = env("OUT", "")
sweep = env("SWEEP", "1") == "1"
confirm_top, confirm_reps = int(env("CONFIRM_TOP", "5")), int(env("CONFIRM_REPS", "8"))
text = env("QUALITY_TEXT", "")
chunks, ctx = env("QUALITY_CHUNKS", "4"), env("QUALITY_CTX", "256")
also = env("CONFIRM_ALSO", "").split()

acts, model = settings["actions"], settings["model"]
fixed = [
    f"fixed:K={k},b={b},d={d},q={q}"
    for k, q, b, d in itertools.product(
        acts["stages"], acts["queue_depths"], acts["prefetch_breadths"], acts["deadline_factors"]
    )
]
n_layers, w_skip, w_waste = model["n_layers"], model["w_skip_us"], model["w_waste_us_per_mib"]
bundle = model["bundle_bytes"]


def interpolated(points, b):
    # As `ModelParams::recall`: from 0 at breadth 0, linear between the
    # points, flat past the last.
    prev = (0.0, 0.0)
    for x, y in points:
        if b <= x:
            f = (b - prev[0]) / (x - prev[0]) if x > prev[0] else 1.0
            return min(max(prev[1] + f * (y - prev[1]), 0.0), 1.0)
        prev = (x, y)
    return min(max(prev[1], 0.0), 1.0)


def offline_recall(b):
    points = [tuple(p) for p in model.get("recall_by_breadth") or []]
    if not points:
        return 1.0 - (1.0 - model["recall_at_1"]) ** b
    return interpolated(points, b)


def bench(controller, quality=False):
    cmd = [exe, "bench", "--model", flash, "--policy", "speculate", "--controller", controller,
           "--ffn-budget", budget, "--sparsity", sparsity, "--prompt-tokens", "0",
           "--gen-tokens", gen, "--reps", "1"]
    if quality:
        cmd += ["--quality-file", text, "--quality-chunks", chunks, "--quality-ctx", ctx]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"leanstream bench with --controller {controller} failed:\n{done.stderr}")
    return json.loads(done.stdout)


log = open(out, "w" if sweep else "a")


def record(kind, row):
    log.write(json.dumps({"kind": kind, **row}) + "\n")
    log.flush()


# The engine's recall at each breadth, audited on real text.
breadths = sorted(acts["prefetch_breadths"])
recall_rows = {}
if text and not sweep:
    # Reused with the sweep's rows.
    with open(out) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "recall":
                recall_rows[row["breadth"]] = row
    if sorted(recall_rows) != breadths:
        recall_rows = {}
if text and recall_rows:
    engine_points = [(b, recall_rows[b]["recall"]) for b in breadths]
elif text:
    print(f"engine recall on {text} ({chunks} chunks of {ctx}), no deadline:", file=sys.stderr)
    for b in breadths:
        c = f"fixed:K=1,b={b},d=inf,q={max(acts['queue_depths'])}"
        q = bench(c, quality=True)["quality"]
        recall_rows[b] = {"controller": c, "recall": 1.0 - q["skipped_mass"], "ppl_ratio": q["ppl_ratio"],
                          "ppl_ratio_stderr": q["ppl_ratio_stderr"], "top1_agreement": q["top1_agreement"]}
        record("recall", {"breadth": b, "offline_recall": offline_recall(b), **recall_rows[b]})
        print(f"  b={b}: {recall_rows[b]['recall']:.4f} (offline {offline_recall(b):.4f})", file=sys.stderr)
    engine_points = [(b, recall_rows[b]["recall"]) for b in breadths]


def recall(b):
    return interpolated(engine_points, b) if text else offline_recall(b)


def run(controller, quality=False):
    r = bench(controller, quality)
    sp = r["speculate"]
    misses = r["bytes_requested_per_token"] / bundle
    needed = misses / r["cache_miss_ratio"] if r["cache_miss_ratio"] > 0 else misses
    late_share = sp["late_skipped_per_token"] / needed if needed > 0 else 0.0
    wasted_mib = max(r["bytes_read_per_token"] - r["bytes_requested_per_token"], 0.0) / 2**20
    decisions = sum(a["layers"] for a in sp["actions"])
    missed = sum(a["layers"] * (1.0 - recall(a["prefetch_breadth"])) for a in sp["actions"]) / max(decisions, 1)
    skipped_mass = 1.0 - (1.0 - missed) * (1.0 - late_share)
    row = {
        "controller": controller,
        "decode_tok_s": r["decode_tok_s"],
        "missed_by_breadth": missed,
        "late_share": late_share,
        "wasted_mib_per_token": wasted_mib,
        "cost_us": 1e6 / r["decode_tok_s"] + w_skip * n_layers * skipped_mass + w_waste * wasted_mib,
        "actions": [a["code"] for a in sp["actions"]],
    }
    if quality:
        q = r["quality"]
        row |= {"ppl_ratio": q["ppl_ratio"], "ppl_ratio_stderr": q["ppl_ratio_stderr"],
                "top1_agreement": q["top1_agreement"], "skipped_mass": q["skipped_mass"]}
    return row


controllers = [table] + fixed
rows = {c: [] for c in controllers}
if sweep:
    for rep in range(reps):
        for i, c in enumerate(controllers):
            row = run(c)
            rows[c].append(row)
            record("sweep", {"rep": rep, **row})
            print(f"rep {rep} {i + 1}/{len(controllers)} {c}: {row['decode_tok_s']:.2f} tok/s, "
                  f"late {row['late_share']:.3f}, cost {row['cost_us']:.0f} µs", file=sys.stderr)
else:
    with open(out) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "sweep" and row["controller"] in rows:
                rows[row["controller"]].append(row)
    missing = [c for c in controllers if not rows[c]]
    if missing:
        sys.exit(f"{out}: no sweep rows for {missing[0]} (and {len(missing) - 1} more); run with SWEEP=1")


def mean(c, k):
    return sum(r[k] for r in rows[c]) / len(rows[c])


by_cost = sorted(fixed, key=lambda c: mean(c, "cost_us"))
by_speed = sorted(fixed, key=lambda c: -mean(c, "decode_tok_s"))
rank = 1 + sum(mean(c, "cost_us") < mean(table, "cost_us") for c in fixed)
print(f"\n{flash}: speculate, {budget} cache, sparsity {sparsity}, {gen} tokens x {reps} interleaved reps")
if text:
    print(f"\nrecall at each breadth (no deadline): the engine's, audited on {text}, against the "
          "predictor's offline recall in the table's settings")
    print("| breadth | engine recall | offline recall | ppl ratio to dense | top-1 |")
    print("|---|---|---|---|---|")
    for b in breadths:
        r = recall_rows[b]
        print(f"| {b} | {r['recall']:.4f} | {offline_recall(b):.4f} | {r['ppl_ratio']:.3f} ± "
              f"{r['ppl_ratio_stderr']:.3f} | {r['top1_agreement']:.3f} |")
    print()
print(f"cost per token = time + {w_skip:g} µs x {n_layers} layers x skipped mass "
      f"(1 - {'engine' if text else 'offline'} recall(b) x (1 - late share)) + {w_waste:g} µs/MiB x wasted MiB")
print("| controller | decode tok/s | missed by breadth | late share | wasted MiB/token | cost µs/token |")
print("|---|---|---|---|---|---|")
for c in [table] + by_cost[:5] + [by_speed[0]]:
    print(f"| {c} | {mean(c, 'decode_tok_s'):.2f} | {mean(c, 'missed_by_breadth'):.4f} | "
          f"{mean(c, 'late_share'):.4f} | {mean(c, 'wasted_mib_per_token'):.2f} | {mean(c, 'cost_us'):.0f} |")
print(f"the table ranks {rank} of {len(fixed) + 1} by cost; best fixed by cost: {by_cost[0]}, "
      f"by speed: {by_speed[0]}; table / best fixed cost = {mean(table, 'cost_us') / mean(by_cost[0], 'cost_us'):.3f}")
if confirm_top == 0 or confirm_reps == 0:
    sys.exit(0)

# Confirmation: fresh rounds, order shuffled in each, paired by round.
contenders = [table] + by_cost[:confirm_top] + also
paired = {c: [] for c in contenders}
shuffle = random.Random(0)
for rep in range(confirm_reps):
    order = contenders[:]
    shuffle.shuffle(order)
    for i, c in enumerate(order):
        row = run(c)
        paired[c].append(row["cost_us"])
        record("confirm", {"rep": rep, **row})
        print(f"confirm {rep} {i + 1}/{len(order)} {c}: {row['decode_tok_s']:.2f} tok/s, "
              f"cost {row['cost_us']:.0f} µs", file=sys.stderr)


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def ratio_interval(logs):
    # Geometric mean of the per-round ratios and a 95% percentile bootstrap.
    draw = random.Random(1)
    means = sorted(sum(draw.choice(logs) for _ in logs) / len(logs) for _ in range(4000))
    return math.exp(sum(logs) / len(logs)), math.exp(means[100]), math.exp(means[3899])


fixed_contenders = [c for c in contenders if c.startswith("fixed:")]
best = min(fixed_contenders, key=lambda c: sum(math.log(x) for x in paired[c]))
print(f"\nconfirmation: the table against the sweep's best {confirm_top} fixed actions"
      + (f" and {len(also)} other table(s)" if also else "") + f", {confirm_reps} rounds in shuffled order; "
      f"each against the best of them ({best}), paired by round")
print("| controller | median cost µs/token | / best fixed (geometric mean of rounds) | 95% interval |")
print("|---|---|---|---|")
verdicts = []
for c in contenders:
    if c == best:
        print(f"| {c} | {median(paired[c]):.0f} | 1 | |")
        continue
    g, lo, hi = ratio_interval([math.log(x / y) for x, y in zip(paired[c], paired[best])])
    print(f"| {c} | {median(paired[c]):.0f} | {g:.3f} | {lo:.3f}-{hi:.3f} |")
    if not c.startswith("fixed:"):
        verdict = "costlier" if lo > 1 else ("cheaper" if hi < 1 else "not distinguishable")
        verdicts.append(f"{c}: {g:.3f}x the best confirmed fixed action (95% interval {lo:.3f}-{hi:.3f}), {verdict}")
if text:
    print(f"\nquality on {text} ({chunks} chunks of {ctx}), one audited run each")
    print("| controller | ppl ratio to dense | top-1 agreement | skipped mass (audited) |")
    print("|---|---|---|---|")
    for c in contenders:
        row = run(c, quality=True)
        record("quality", row)
        print(f"| {c} | {row['ppl_ratio']:.3f} ± {row['ppl_ratio_stderr']:.3f} | "
              f"{row['top1_agreement']:.3f} | {row['skipped_mass']:.4f} |")
print("\n" + "\n".join(verdicts))
