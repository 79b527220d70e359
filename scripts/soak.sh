#!/usr/bin/env bash
# Long runs inside a memory cgroup that charges the page cache: for every
# streaming policy, one TOKENS-token generation (sampled, end-of-generation
# banned so it runs its length) with --mem-budget BUDGET in a cgroup of
# BUDGET + SLACK_MIB, the resident set printed every 100 tokens; then a server
# soak (`leanstream serve` under the same cap, REQUESTS mixed requests from
# scripts/serve_load.py, its RSS sampled every 2 s). Reports per run: exit
# (137 = OOM-killed), the cgroup's peak, RSS at the first sample, at its
# highest and at the end, and growth from token 500 to the end.
#
# Usage: scripts/soak.sh [MODEL] [BUDGET_MIB]   (default: smollm2 160; a
#        2000-token context's KV cache alone is 54 MiB of it for SmolLM2)
# Env: TOKENS (2000), POLICIES (the seven streaming ones), SPARSITY (0.5),
#      SLACK_MIB (16), REQUESTS (100), OUT (default $LEANSTREAM_HOME/soak),
#      PROFILE (cargo profile of the binaries, release).
# Needs root (cgroup memory controller). Artifacts are made as in
# scripts/bench_speculate.sh and land beside the packed file.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
model=${1:-smollm2} budget=${2:-160}
tokens=${TOKENS:-2000} sparsity=${SPARSITY:-0.5} slack=${SLACK_MIB:-16} requests=${REQUESTS:-100}
policies=${POLICIES:-dense-stream,oracle,gate-first,speculate,dejavu,llm-in-a-flash,powerinfer2}
out=${OUT:-$home/soak}
profile=${PROFILE:-release}
cargo build --profile "$profile" --bin leanstream --bin leanstream-profile --bin leanstream-synth >&2
bin=$CARGO_TARGET_DIR/$profile
read -r train heldout < <(scripts/prepare_text.sh)
mkdir -p "$out" "$home/flash"
gguf=$("$bin/leanstream" fetch "$model")
name=$(basename "$gguf" .gguf)
flash=$home/flash/$name.lsflash
[ -f "$flash" ] || "$bin/leanstream" pack --model "$gguf" -o "$flash" --calibrate data/text/apache-2.0.txt \
  --sparsities 0.5,0.7,0.8 --hot-first >&2
if [ ! -f "$home/flash/$name.lspred" ]; then
  "$bin/leanstream-profile" activations --model "$gguf" --text "$train" --heldout "$heldout" \
    -o "$home/acts/$name" --max-tokens "${TRACE_TOKENS:-4096}" >&2
  "$bin/leanstream-synth" predictor --acts "$home/acts/$name" -o "$home/flash/$name.lspred" \
    --sparsity "$sparsity" --baseline "$home/flash/$name.lowrank.lspred" --quiet > /dev/null
fi
prompt=$(head -c 600 "$heldout" | tr '\n' ' ')

# Runs "$@" in a fresh memory cgroup of $1 MiB (page cache charged, no swap);
# its stderr goes to $err; prints "EXIT <code> PEAK <bytes>".
in_cgroup() {
  local limit=$1; shift
  local cg code=0 peak
  if [ -f /sys/fs/cgroup/unified/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/unified/cgroup.controllers; then
    cg=/sys/fs/cgroup/unified/leanstream-soak-$$; mkdir "$cg"
    echo $((limit << 20)) > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" > /dev/null 2> "$err" || code=$?
    peak=$(cat "$cg/memory.peak" 2>/dev/null || echo 0)
  else
    cg=/sys/fs/cgroup/memory/leanstream-soak-$$; mkdir "$cg"
    echo $((limit << 20)) > "$cg/memory.limit_in_bytes"
    echo $((limit << 20)) > "$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" > /dev/null 2> "$err" || code=$?
    peak=$(cat "$cg/memory.max_usage_in_bytes")
  fi
  rmdir "$cg"
  echo "EXIT $code PEAK $peak"
}

summary() { # label, the in_cgroup line, a file of {"token"|"t", "rss_bytes"} lines
  python3 - "$1" "$2" "$3" "$budget" "$slack" <<'PY'
import json, sys
label, line, samples, budget, slack = sys.argv[1], sys.argv[2].split(), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = []
for l in open(samples, errors="replace"):
    l = l.strip()
    if l.startswith("{") and "rss_bytes" in l:
        try:
            s.append(json.loads(l))
        except ValueError:
            pass
mib = lambda b: round(b / 2**20, 1)
key = "token" if s and "token" in s[0] else "t"
late = [x for x in s if x[key] >= (500 if key == "token" else 30)]
r = {"run": label, "exit": int(line[1]), "oom_killed": int(line[1]) == 137,
     "budget_mib": budget, "cgroup_limit_mib": budget + slack, "cgroup_peak_mib": mib(int(line[3])),
     "samples": len(s), "last_at": s[-1][key] if s else None,
     "rss_first_mib": mib(s[0]["rss_bytes"]) if s else None,
     "rss_max_mib": mib(max(x["rss_bytes"] for x in s)) if s else None,
     "rss_last_mib": mib(s[-1]["rss_bytes"]) if s else None,
     "growth_mib": mib(late[-1]["rss_bytes"] - late[0]["rss_bytes"]) if len(late) > 1 else None}
print(json.dumps(r))
PY
}

results=$out/$name.jsonl
: > "$results"
for p in ${policies//,/ }; do
  err=$out/$name.$p.log
  echo "soak $name: $p, $tokens tokens, budget ${budget} MiB in a cgroup of $((budget + slack)) MiB" >&2
  line=$(in_cgroup $((budget + slack)) "$bin/leanstream" run --model "$flash" --policy "$p" \
    --mem-budget "${budget}MiB" --sparsity "$sparsity" --prompt "$prompt" -n "$tokens" --ignore-eos \
    --rss-every 100 --seed 1 --ctx $((tokens + 512)))
  summary "$p" "$line" "$err" | tee -a "$results"
done

# The server: same cap, mixed chat and completion requests, RSS every 2 s.
port=$((20000 + $$ % 10000))
err=$out/$name.serve.log
samples=$out/$name.serve.rss
: > "$samples"
: > "$err"
(in_cgroup $((budget + slack)) "$bin/leanstream" serve --model "$flash" --policy speculate \
  --mem-budget "${budget}MiB" --sparsity "$sparsity" --port "$port" --ctx 1024 > "$out/$name.serve.exit") &
server=$!
until grep -q listening "$err" 2>/dev/null; do
  kill -0 "$server" 2>/dev/null || { echo "the server did not start:" >&2; tail -3 "$err" >&2; exit 1; }
  sleep 0.5
done
pid=$(pgrep -f "serve --model $flash --policy speculate" | head -1)
(
  t=0
  while kill -0 "$pid" 2>/dev/null; do
    rss=$(awk '/^VmRSS:/ {print $2 * 1024}' "/proc/$pid/status" 2>/dev/null || echo)
    [ -n "$rss" ] && echo "{\"t\": $t, \"rss_bytes\": $rss}" >> "$samples"
    sleep 2; t=$((t + 2))
  done
) &
sampler=$!
python3 scripts/serve_load.py --url "http://127.0.0.1:$port" --requests "$requests" --clients 4 \
  --max-tokens 64 > "$out/$name.serve-load.json"
kill -INT "$pid"
wait "$sampler" 2>/dev/null || true
wait
summary "serve (speculate, $requests requests)" "$(cat "$out/$name.serve.exit")" "$samples" | tee -a "$results"
python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["outcomes"]))' "$out/$name.serve-load.json"
