#!/usr/bin/env bash
# Real prose for activation traces: Debian's fortunes (installed with apt when
# missing), '%' separators removed, into $LEANSTREAM_HOME/text (default
# ~/.cache/leanstream/text). Training and held-out texts come from different
# fortune files, so no quotation is in both.
#   train.txt   literature wisdom people humorists science fortunes
#   heldout.txt law politics education (first 24 KB)
set -euo pipefail
dir=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}/text
src=/usr/share/games/fortunes
if [ ! -f "$src/literature" ]; then
  echo "installing Debian's fortunes package ..." >&2
  ${SUDO:-} apt-get install -y -q fortunes >/dev/null
fi
mkdir -p "$dir"
join() { for f in "$@"; do sed -e '/^%$/d' "$src/$f"; done; }
join literature wisdom people humorists science fortunes > "$dir/train.txt"
join law politics education > "$dir/heldout.all"
head -c 24000 "$dir/heldout.all" > "$dir/heldout.txt" && rm "$dir/heldout.all"
echo "$dir/train.txt $dir/heldout.txt"
wc -c "$dir/train.txt" "$dir/heldout.txt" >&2
