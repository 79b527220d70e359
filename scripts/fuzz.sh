#!/usr/bin/env bash
# Coverage-guided fuzzing of every reader of outside bytes with AFL++
# (cargo-afl, on the stable toolchain). Targets: `leanstream-fuzz list`.
#
# Usage:
#   scripts/fuzz.sh seeds                 rewrite the seed corpus under data/fuzz
#   scripts/fuzz.sh build                 instrumented build (its own target dir)
#   scripts/fuzz.sh run TARGET SECONDS    fuzz one target; findings under $FUZZ_OUT/TARGET
#   scripts/fuzz.sh all SECONDS [JOBS]    every target for SECONDS, JOBS at a time (default: cores)
#   scripts/fuzz.sh report                executions, crashes, hangs and coverage per target
# Env: TARGETS (comma list for `all`; default every target),
#      FUZZ_OUT (default ~/.cache/leanstream/fuzz), AFL_PROFILE (cargo profile
# of the instrumented build, ci), AFL_MEM_MB (address-space
# limit per run, 4096: a reader that asks for more on a small input is a bug).
#
# A crash found: reproduce with `leanstream-fuzz replay TARGET FILE`, fix the
# reader, and keep the input as data/fuzz/TARGET/crashes/NAME; tests/corpus.rs
# (in the fuzz crate) replays every kept input on each test run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
afl_target=${AFL_TARGET_DIR:-$HOME/.cache/leanstream/target-afl}
out=${FUZZ_OUT:-$HOME/.cache/leanstream/fuzz}
# No LTO (the `ci` profile): the instrumented link of polars is slow enough.
profile=${AFL_PROFILE:-ci}
bin=$afl_target/$profile/leanstream-fuzz-afl

ensure_afl() {
  command -v cargo-afl >/dev/null || cargo install --locked cargo-afl
  cargo afl config --build >/dev/null 2>&1 || true
}

fuzz_one() { # TARGET SECONDS
  local t=$1 secs=$2
  mkdir -p "$out"
  # -i - resumes a target that has fuzzed before; a fresh one starts from its seeds.
  local input=data/fuzz/$t/seeds
  [ -d "$out/$t/default/queue" ] && input=-
  AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1 \
    AFL_SKIP_CRASHES=1 AFL_AUTORESUME=1 \
    cargo afl fuzz -i "$input" -o "$out/$t" -V "$secs" -m "${AFL_MEM_MB:-4096}" -t 2000 -- "$bin" "$t" \
    > "$out/$t.log" 2>&1 || { echo "afl-fuzz $t failed; see $out/$t.log" >&2; tail -20 "$out/$t.log" >&2; return 1; }
}

case ${1:-} in
  seeds)
    cargo build --profile ci -p leanstream-fuzz -p leanstream-profiler --bins
    "$CARGO_TARGET_DIR/ci/leanstream-fuzz" seeds
    ;;
  build)
    ensure_afl
    CARGO_TARGET_DIR=$afl_target cargo afl build --profile "$profile" -p leanstream-fuzz --features afl \
      --bin leanstream-fuzz-afl
    ;;
  run)
    fuzz_one "$2" "$3"
    ;;
  all)
    secs=$2 jobs=${3:-$(nproc)}
    cargo build --profile ci -p leanstream-fuzz --bin leanstream-fuzz
    targets=${TARGETS:-$("$CARGO_TARGET_DIR/ci/leanstream-fuzz" list)}
    for t in ${targets//,/ }; do
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
      echo "fuzzing $t for ${secs}s" >&2
      fuzz_one "$t" "$secs" &
    done
    wait
    "$0" report
    ;;
  report)
    python3 - "$out" <<'PY'
import os, sys, json
out = sys.argv[1]
rows, total = [], 0
for t in sorted(os.listdir(out)):
    stats = os.path.join(out, t, "default", "fuzzer_stats")
    if not os.path.isfile(stats):
        continue
    s = dict(l.split(":", 1) for l in open(stats).read().splitlines() if ":" in l)
    s = {k.strip(): v.strip() for k, v in s.items()}
    execs = int(s["execs_done"]); total += execs
    rows.append({"target": t, "execs": execs, "run_time_s": int(s.get("run_time", 0)),
                 "execs_per_s": float(s["execs_per_sec"]), "corpus": int(s["corpus_count"]),
                 "edges": int(s.get("edges_found", 0)), "coverage": s.get("bitmap_cvg", "?"),
                 "crashes": int(s["saved_crashes"]), "hangs": int(s["saved_hangs"])})
print(f"{'target':20} {'execs':>11} {'exec/s':>8} {'corpus':>7} {'edges':>6} {'cov':>7} {'crash':>6} {'hang':>5}")
for r in rows:
    print(f"{r['target']:20} {r['execs']:>11} {r['execs_per_s']:>8.0f} {r['corpus']:>7} {r['edges']:>6} {r['coverage']:>7} {r['crashes']:>6} {r['hangs']:>5}")
print(f"{'total':20} {total:>11}")
print(json.dumps({"targets": rows, "total_execs": total}))
PY
    ;;
  *)
    sed -n 2,17p "$0" >&2
    exit 2
    ;;
esac
