#!/usr/bin/env bash
# The flash I/O engine against fio on the same file, same request size and
# queue depth, O_DIRECT random reads, one job each; runs alternate (REPS
# rounds) and the medians and their ratio are printed, since this machine's
# disk speed drifts between minutes.
#
# Usage: scripts/bench_io.sh FILE [BS:DEPTH ...]   (default: 4k:32 128k:8)
# Env: REPS (3), SECONDS_EACH (5), BACKEND (auto), OUT (JSON lines; default a temp file)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/leanstream/target}
file=$1; shift
[ $# -gt 0 ] || set -- 4k:32 128k:8
reps=${REPS:-3} secs=${SECONDS_EACH:-5}
command -v fio >/dev/null || { apt-get update >&2 && apt-get install -y fio >&2; }
cargo build --release --bin leanstream >&2
ls=$CARGO_TARGET_DIR/release/leanstream
out=${OUT:-$(mktemp)}
: > "$out"
for ((r = 0; r < reps; r++)); do
  for c in "$@"; do
    bs=${c%%:*} depth=${c##*:}
    fio --name=bench-io --filename="$file" --readonly --direct=1 --ioengine=io_uring --rw=randread \
      --bs="$bs" --iodepth="$depth" --numjobs=1 --runtime="$secs" --time_based --output-format=json 2>/dev/null |
      python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print(json.dumps({"who": "fio", "cfg": sys.argv[1], "bw": j["bw_bytes"], "iops": j["iops"]}))' "$c" >> "$out"
    "$ls" bench-io --file "$file" --bs "$bs" --depth "$depth" --seconds "$secs" --backend "${BACKEND:-auto}" |
      python3 -c 'import json,sys; j=json.load(sys.stdin); print(json.dumps({"who": "engine", "cfg": sys.argv[1], "bw": j["bytes_per_s"], "iops": j["iops"], "backend": j["backend"], "direct": j["direct"]}))' "$c" >> "$out"
  done
done
python3 - "$out" "$@" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| request, depth | fio MB/s (IOPS) | engine MB/s (IOPS) | engine / fio (median of per-round ratios) |")
print("|---|---|---|---|")
for c in sys.argv[2:]:
    f = [r for r in rows if r["cfg"] == c and r["who"] == "fio"]
    e = [r for r in rows if r["cfg"] == c and r["who"] == "engine"]
    ratios = [b["bw"] / a["bw"] for a, b in zip(f, e) if a["bw"] > 0]
    med = lambda v: statistics.median(v) if v else 0.0
    print(f"| {c} | {med([r['bw'] for r in f]) / 1e6:.0f} ({med([r['iops'] for r in f]):.0f}) "
          f"| {med([r['bw'] for r in e]) / 1e6:.0f} ({med([r['iops'] for r in e]):.0f}, {e[0]['backend'] if e else '?'}) "
          f"| {med(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)}) |")
PY
