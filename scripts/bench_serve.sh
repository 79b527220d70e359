#!/usr/bin/env bash
# `leanstream serve` against llama-server on the same GGUF, threads and
# context, one request at a time each (llama-server -np 1), under the same
# load (scripts/serve_load.py: REQUESTS from CLIENTS concurrent clients, mixed
# chat/completions and streamed/not, every 10th stream cancelled): time to
# first token p50/p99, completion tokens/s and peak RSS, with the ratios.
# With FLASH=1 a third run serves the model packed as .lsflash under
# --mem-budget $BUDGET (dense-stream) and reports its peak RSS against it.
#
#   scripts/bench_serve.sh [MODEL] [REQUESTS] [CLIENTS] [MAX_TOKENS]
#   env: THREADS (2), CTX (2048), REPS (1, runs alternate), LLAMA_ARGS, FLASH, BUDGET (160MiB), OUT
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
model=${1:-smollm2}
requests=${2:-200}
clients=${3:-8}
max_tokens=${4:-16}
threads=${THREADS:-2}
ctx=${CTX:-2048}
reps=${REPS:-1}
budget=${BUDGET:-160MiB}
cargo build --release --bin leanstream >&2
ls=$CARGO_TARGET_DIR/release/leanstream
case $model in
  smollm2 | gemma3) gguf=$("$ls" fetch "$model") ;;
  *) gguf=$model ;;
esac
bin=$(LLAMA_SERVER=1 scripts/llama_cpp.sh)
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
port=18431

up() {
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# run NAME COMMAND...: start a server, load it, record its peak RSS, stop it.
run() {
  local name=$1
  shift
  "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  up || { cat "$out/$name.log" >&2; exit 1; }
  python3 scripts/serve_load.py --url "http://127.0.0.1:$port" --requests "$requests" --clients "$clients" \
    --max-tokens "$max_tokens" >"$out/$name.json" || echo "bench_serve: $name lost requests" >&2
  awk '/VmHWM/ {print $2 * 1024}' "/proc/$pid/status" >"$out/$name.rss"
  kill "$pid"
  wait "$pid" || true
}

if [ "${FLASH:-}" = 1 ]; then
  "$ls" pack --model "$gguf" -o "$out/model.lsflash" >&2
fi
for r in $(seq "$reps"); do
  run "leanstream.$r" "$ls" --threads "$threads" serve --model "$gguf" --port "$port" --ctx "$ctx"
  # shellcheck disable=SC2086
  run "llama-server.$r" "$bin/llama-server" -m "$gguf" -t "$threads" -c "$ctx" -np 1 --host 127.0.0.1 \
    --port "$port" ${LLAMA_ARGS:-}
  if [ "${FLASH:-}" = 1 ]; then
    run "leanstream-flash.$r" "$ls" --threads "$threads" serve --model "$out/model.lsflash" --port "$port" \
      --ctx "$ctx" --policy dense-stream --mem-budget "$budget"
  fi
done

python3 - "$out" "$reps" "$budget" <<'EOF'
import json, statistics, sys
out, reps, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def runs(name):
    rs = []
    for r in range(1, reps + 1):
        try:
            v = json.load(open(f"{out}/{name}.{r}.json"))
        except (OSError, ValueError):
            continue
        v["rss"] = int(open(f"{out}/{name}.{r}.rss").read().strip() or 0)
        rs.append(v)
    return rs
med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None
report = {}
for name in ["leanstream", "llama-server", "leanstream-flash"]:
    rs = runs(name)
    if rs:
        report[name] = {k: med(rs, k) for k in ["ttft_p50_s", "ttft_p99_s", "tokens_per_s", "rss"]}
        report[name]["outcomes"] = rs[-1]["outcomes"]
ours, theirs = report.get("leanstream"), report.get("llama-server")
if ours and theirs:
    report["ratios"] = {
        "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "ttft_p50_speedup": theirs["ttft_p50_s"] / ours["ttft_p50_s"],
        "ttft_p99_speedup": theirs["ttft_p99_s"] / ours["ttft_p99_s"],
        "peak_rss": ours["rss"] / theirs["rss"],
    }
if "leanstream-flash" in report:
    report["leanstream-flash"]["budget"] = budget
report["out"] = out
print(json.dumps(report, indent=1))
EOF
