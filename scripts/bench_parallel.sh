#!/usr/bin/env bash
# Concurrent clients against `leanstream serve --parallel C` and llama-server
# `-np C` on the same model, for each C: aggregate decode throughput, time to
# first token p50/p99 (scripts/bench_parallel.py: C clients at once, each a
# greedy completion of GEN tokens after its own window of real prose), and
# the ratios. llama-server splits its context among its slots, so it gets
# CTX per slot as ours does.
#
# Without LIMIT_MIB both serve the GGUF in memory. With LIMIT_MIB each server
# runs in a memory cgroup of that size (page cache charged; needs root), and
# ours serves the packed model under --mem-budget LIMIT_MIB - SLACK_MIB with
# POLICY; the model files' pages are dropped before each server starts.
#
#   scripts/bench_parallel.sh MODEL [CLIENTS...]     (MODEL: smollm2, gemma3 or a .gguf; CLIENTS: 1 2 4 8)
#   env: LIMIT_MIB, SLACK_MIB (16), POLICY (dense-stream), SPARSITY (0),
#        FLASH (the packed file; default: packed once beside the cache's others),
#        OURS_ARGS (more flags of ours, e.g. --batched-kernels), CTX (512), GEN (128), ROUNDS (2), WORDS (48: words of prose a prompt), THREADS (nproc), PROFILE (release), OUT
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
model=$1; shift
clients=("$@"); [ ${#clients[@]} -gt 0 ] || clients=(1 2 4 8)
ctx=${CTX:-512} gen=${GEN:-128} rounds=${ROUNDS:-2} words=${WORDS:-48} threads=${THREADS:-$(nproc)}
limit=${LIMIT_MIB:-} slack=${SLACK_MIB:-16} policy=${POLICY:-dense-stream} sparsity=${SPARSITY:-0}
ls=$(scripts/leanstream_bin.sh)
bin=$(LLAMA_SERVER=1 scripts/llama_cpp.sh)
gguf=$("$ls" fetch "$model" 2>/dev/null || echo "$model")
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
port=18433
ours=(--model "$gguf")
if [ -n "$limit" ]; then
  flash=${FLASH:-$home/flash/$(basename "$gguf" .gguf).batch.lsflash}
  [ -f "$flash" ] || "$ls" pack --model "$gguf" -o "$flash" >&2
  ours=(--model "$flash" --policy "$policy" --sparsity "$sparsity" --mem-budget "$((limit - slack))MiB")
fi

evict() { python3 -c 'import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)' "$@"; }

# A memory cgroup of $limit MiB (v2 where its memory controller is, else v1).
cg=""
make_cgroup() {
  if [ -f /sys/fs/cgroup/unified/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/unified/cgroup.controllers; then
    cg=/sys/fs/cgroup/unified/leanstream-par-$$; mkdir "$cg"
    echo $((limit << 20)) >"$cg/memory.max"; echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
  else
    cg=/sys/fs/cgroup/memory/leanstream-par-$$; mkdir "$cg"
    echo $((limit << 20)) >"$cg/memory.limit_in_bytes"
  fi
}
peak() { cat "$cg/memory.peak" 2>/dev/null || cat "$cg/memory.max_usage_in_bytes" 2>/dev/null || echo 0; }

# run NAME COMMAND...: start a server (in the cgroup with LIMIT_MIB), load it
# with C clients, stop it; the result goes to $out/NAME.json.
run() {
  local name=$1 c=$2; shift 2
  [ -z "$limit" ] || { evict "$gguf" ${flash:+"$flash"}; make_cgroup; }
  if [ -n "$limit" ]; then
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" >"$out/$name.log" 2>&1 &
  else
    "$@" >"$out/$name.log" 2>&1 &
  fi
  local pid=$! ok=0
  for _ in $(seq 3000); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && { ok=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ $ok = 1 ]; then
    python3 scripts/bench_parallel.py --url "http://127.0.0.1:$port" --clients "$c" --max-tokens "$gen" \
      --rounds "$rounds" --words "$words" >"$out/$name.json" 2>"$out/$name.err" || echo "warning: $name failed: $(tail -n1 "$out/$name.err")" >&2
  else
    echo "warning: $name did not start: $(tail -n1 "$out/$name.log")" >&2
  fi
  curl -sf "http://127.0.0.1:$port/metrics" >"$out/$name.metrics" 2>/dev/null || true
  [ -z "$limit" ] || peak >"$out/$name.peak"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  [ -z "$limit" ] || rmdir "$cg"
}

for c in "${clients[@]}"; do
  run "llama.$c" "$c" "$bin/llama-server" -m "$gguf" -t "$threads" -c $((ctx * c)) -np "$c" --host 127.0.0.1 --port "$port"
  # shellcheck disable=SC2086
  run "leanstream.$c" "$c" "$ls" --threads "$threads" serve "${ours[@]}" --ctx "$ctx" --parallel "$c" \
    --no-prompt-cache --port "$port" ${OURS_ARGS:-}
done

python3 - "$out" "$limit" "${clients[@]}" <<'EOF'
import json, sys
out, limit, clients = sys.argv[1], sys.argv[2], sys.argv[3:]
def load(name):
    try:
        v = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError):
        return None
    try:
        v["peak_mib"] = int(open(f"{out}/{name}.peak").read()) / 2**20
    except (OSError, ValueError):
        pass
    try:
        for line in open(f"{out}/{name}.metrics"):
            if line.startswith("leanstream_read_bytes_per_token "):
                v["read_mib_per_token"] = float(line.split()[1]) / 2**20
    except OSError:
        pass
    return v
base = load("leanstream.1")
rows = []
print(f"| clients | llama-server tok/s | LeanStream tok/s | ratio | LeanStream vs 1 client | TTFT p50/p99 s (llama / ours) | ours MiB read a token |")
print("|---|---|---|---|---|---|---|")
for c in clients:
    l, o = load(f"llama.{c}"), load(f"leanstream.{c}")
    f = lambda v, k: f"{v[k]:.2f}" if v else "failed"
    ratio = f"{o['tok_s'] / l['tok_s']:.2f}x" if l and o else "-"
    scale = f"{o['tok_s'] / base['tok_s']:.2f}x" if o and base else "-"
    ttft = lambda v: f"{v['ttft_p50_s']:.2f}/{v['ttft_p99_s']:.2f}" if v else "-"
    read = f"{o['read_mib_per_token']:.1f}" if o and "read_mib_per_token" in o else "-"
    print(f"| {c} | {f(l, 'tok_s')} | {f(o, 'tok_s')} | {ratio} | {scale} | {ttft(l)} / {ttft(o)} | {read} |")
    rows.append({"clients": int(c), "llama_server": l, "leanstream": o})
json.dump({"limit_mib": limit or None, "runs": rows}, open(f"{out}/summary.json", "w"), indent=1)
print(f"(details: {out})")
EOF
