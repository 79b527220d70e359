#!/usr/bin/env bash
# The users' yardstick: llama.cpp and LeanStream on the same model under the
# same memory limit, a memory cgroup that also charges the page cache. For
# each limit, in one run: llama-bench decode speed on the GGUF (mmap, as users
# run it), LeanStream's dense engine on the same GGUF (mmap too), and
# `leanstream bench` on the packed file with --mem-budget set to the limit
# minus a slack for what the budget does not see; the ratio takes the faster
# LeanStream engine (the one a user would pick for that limit).
# The file's pages are evicted before each run, so neither starts with a cache
# it was not charged for. Needs root (cgroup v1 or v2 memory controller).
#
# Usage: scripts/bench_memlimit.sh MODEL LIMIT_MIB... (MODEL: smollm2, gemma3 or a .gguf)
# Env: GEN (32), POLICY (oracle; a comma list gives a column each), SPARSITY
#      (0.5), SLACK_MIB (16), LLAMA_ARGS (extra llama-bench flags), PACK_ARGS
#      (default: a calibration on data/text/apache-2.0.txt, --hot-first), TAG
#      (names the packed file, reused while it exists; default memlimit),
#      PROFILE (release; `ci` reuses scripts/test.sh's build), DRAFT (e.g.
#      lookup: each policy runs `bench-draft` on DRAFT_PROMPTS (4) windows of
#      DRAFT_TEXT (data/text/gpl-3.0.txt) instead of `bench` on random
#      tokens, one column plain and one drafted, in the same process).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
gen=${GEN:-32} policy=${POLICY:-oracle} sparsity=${SPARSITY:-0.5} slack=${SLACK_MIB:-16}
model=$1; shift
ls=$(scripts/leanstream_bin.sh)
llama=$(scripts/llama_cpp.sh)/llama-bench
gguf=$("$ls" fetch "$model" 2>/dev/null || echo "$model")
name=$(basename "$gguf" .gguf)
flash=$home/flash/$name.${TAG:-memlimit}.lsflash
# shellcheck disable=SC2086
[ -f "$flash" ] || "$ls" pack --model "$gguf" -o "$flash" ${PACK_ARGS---calibrate data/text/apache-2.0.txt --hot-first} >&2

evict() { python3 -c 'import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)' "$@"; }

# Runs "$@" in a fresh memory cgroup limited to $limit MiB; prints its output,
# then a line "PEAK <bytes>" (the cgroup's peak usage, page cache included).
in_cgroup() {
  local limit=$1; shift
  local cg
  if [ -f /sys/fs/cgroup/unified/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/unified/cgroup.controllers; then
    cg=/sys/fs/cgroup/unified/leanstream-$$; mkdir "$cg"
    echo $((limit << 20)) > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@"
    echo "PEAK $(cat "$cg/memory.peak" 2>/dev/null || echo 0)"
  else
    cg=/sys/fs/cgroup/memory/leanstream-$$; mkdir "$cg"
    echo $((limit << 20)) > "$cg/memory.limit_in_bytes"
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@"
    echo "PEAK $(cat "$cg/memory.max_usage_in_bytes")"
  fi
  rmdir "$cg"
}

# The decode speed in a JSON report ($1: key path) followed by a PEAK line.
speed_of() { python3 -c 'import json,sys
t=sys.stdin.read(); j=t[:t.rfind("PEAK")].strip()
try:
    v=json.loads(j)
    for k in sys.argv[1].split("."): v=v[int(k)] if k.isdigit() else v[k]
    print(v)
except Exception: print("")' "$1"; }

# A run that printed no speed failed: say why on stderr (its first error
# line) rather than let an empty cell read as a measurement.
errs=$(mktemp -d); trap 'rm -rf "$errs"' EXIT
failed() { echo "warning: $1 at $2 MiB failed: $(grep -m1 -i error "$3" || tail -n1 "$3")" >&2; }

IFS=, read -r -a policies <<<"$policy"
{
  printf '| limit MiB | llama.cpp tok/s (cgroup peak MiB) | LeanStream dense GGUF |'
  for p in "${policies[@]}"; do
    if [ -n "${DRAFT:-}" ]; then
      printf ' LeanStream %s %s .lsflash, prose | the same, --draft %s |' "$p" "$sparsity" "$DRAFT"
    else
      printf ' LeanStream %s %s .lsflash |' "$p" "$sparsity"
    fi
  done
  printf ' best / llama.cpp |\n|---|---|---|'
  for _ in "${policies[@]}"; do printf -- '---|'; [ -z "${DRAFT:-}" ] || printf -- '---|'; done
  printf -- '---|\n'
}
for limit in "$@"; do
  evict "$gguf" "$flash"
  # shellcheck disable=SC2086
  theirs=$(in_cgroup "$limit" timeout 1800 "$llama" -m "$gguf" -p 0 -n "$gen" -r 1 -t "$(nproc)" ${LLAMA_ARGS:-} -o json 2>"$errs/llama" || true)
  evict "$gguf" "$flash"
  dense=$(in_cgroup "$limit" timeout 1800 "$ls" bench --model "$gguf" --prompt-tokens 0 --gen-tokens "$gen" --reps 1 2>"$errs/dense" || true)
  cells=("$(printf '%s\n' "$theirs" | speed_of 0.avg_ts)" "$(printf '%s\n' "$theirs" | sed -n 's/^PEAK //p')"
    "$(printf '%s\n' "$dense" | speed_of decode_tok_s)" "$(printf '%s\n' "$dense" | sed -n 's/^PEAK //p')")
  [ -n "${cells[0]}" ] || failed llama-bench "$limit" "$errs/llama"
  [ -n "${cells[2]}" ] || failed "LeanStream dense GGUF" "$limit" "$errs/dense"
  for p in "${policies[@]}"; do
    evict "$gguf" "$flash"
    budget=(--policy "$p" --sparsity "$sparsity" --mem-budget "$((limit - slack))MiB")
    if [ -n "${DRAFT:-}" ]; then
      ours=$(in_cgroup "$limit" timeout 1800 "$ls" bench-draft --model "$flash" "${budget[@]}" --gen "$gen" \
        --text "${DRAFT_TEXT:-data/text/gpl-3.0.txt}" --prompts "${DRAFT_PROMPTS:-4}" --drafts "$DRAFT" 2>"$errs/$p" || true)
      keys=(runs.0.decode_tok_s runs.1.decode_tok_s)
    else
      ours=$(in_cgroup "$limit" timeout 1800 "$ls" bench --model "$flash" "${budget[@]}" \
        --prompt-tokens 0 --gen-tokens "$gen" --reps 1 2>"$errs/$p" || true)
      keys=(decode_tok_s)
    fi
    for key in "${keys[@]}"; do
      speed=$(printf '%s\n' "$ours" | speed_of "$key")
      [ -n "$speed" ] || failed "LeanStream $p ($key)" "$limit" "$errs/$p"
      cells+=("$speed" "$(printf '%s\n' "$ours" | sed -n 's/^PEAK //p')")
    done
  done
  python3 - "$limit" "${cells[@]}" <<'PY'
import sys
l, v = sys.argv[1], [float(x) if x else None for x in sys.argv[2:]]
m = 1 << 20
cell = lambda s, p: "failed" if s is None else f"{s:.2f} ({(p or 0) / m:.0f})"
ts = v[0]
speeds = [s for s in v[2::2] if s is not None]
best = max(speeds) if speeds else None
ratio = f"{best / ts:.2f}" if ts and best else "llama.cpp failed" if not ts else "LeanStream failed"
cols = " | ".join(cell(s, p) for s, p in zip(v[2::2], v[3::2]))
print(f"| {l} | {cell(ts, v[1])} | {cols} | {ratio} |")
PY
done
