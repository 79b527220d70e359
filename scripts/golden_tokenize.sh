#!/usr/bin/env bash
# Records llama.cpp's token ids for a fixed list of texts into
# data/golden/tokenize.json, for runtime/tests/tokenizer_golden.rs.
#
# Usage: scripts/golden_tokenize.sh [LLAMA_BIN_DIR [SMOLLM2_GGUF [GEMMA3_GGUF]]]
# Defaults: $LLAMA_BIN, else the llama-cpp-python 0.3.36 vendored build under
# scripts/llama_cpp.sh builds (see there); models
# from $LEANSTREAM_SMOLLM2 / $LEANSTREAM_GEMMA3, else `leanstream fetch`'s cache.
#
# Each text is written to a file and tokenized with
#   llama-tokenize -m MODEL -f FILE --ids --log-disable --no-escape
# i.e. the text's bytes verbatim, BOS added when the model's metadata asks for
# it, special tokens parsed (llama-tokenize's defaults).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
home=${LEANSTREAM_HOME:-$HOME/.cache/leanstream}
BIN=${1:-${LLAMA_BIN:-$("$here/llama_cpp.sh")}}
SMOLLM2=${2:-${LEANSTREAM_SMOLLM2:-$home/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}}
GEMMA3=${3:-${LEANSTREAM_GEMMA3:-$home/models/gemma3/gemma-3-270m-q4_k_m.gguf}}
out=$root/data/golden/tokenize.json

for f in "$BIN/llama-tokenize" "$SMOLLM2" "$GEMMA3"; do
  [[ -e $f ]] || { echo "missing: $f" >&2; exit 1; }
done

# Version: the llama-cpp-python release that vendors llama.cpp, and the commit it was built from.
pyver=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$BIN/../../../../llama_cpp/__init__.py" 2>/dev/null || true)
commit=$(sed -n 's/.*LLAMA_COMMIT = "\(.*\)";/\1/p' "$BIN/../common/build-info.cpp" 2>/dev/null || true)
version="llama.cpp vendored by llama-cpp-python ${pyver:-unknown}, commit ${commit:-unknown}"

LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
python3 - "$BIN/llama-tokenize" "$SMOLLM2" "$GEMMA3" "$root/data/text/gpl-3.0-excerpt.txt" "$version" "$out" <<'PY'
import json, os, subprocess, sys, tempfile

tool, smollm2, gemma3, prose_file, version, out = sys.argv[1:]

texts = [
    # plain ASCII
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "HelloWORLD camelCase snake_case SCREAMING_CASE kebab-case",
    "https://example.com/path/to?query=1&b=2#frag user@example.org",
    "$100 + €50 = £150; 50% off!!! ~~~ ^^^ ||| @user #tag `tick`",
    # whitespace
    "a  b   c    d",
    "\tindented\twith\ttabs\t\t\tand more",
    "line1\nline2\n\nline4\n",
    "  leading spaces",
    "trailing spaces   ",
    "   ",
    "\n",
    " ",
    "\r\n windows\r\nline\r\n",
    " \n \t\n  x \n\n\n   y\t \t",
    "word" + " " * 40 + "word",
    "\u00a0nbsp\u3000ideographic\u2009thin\u2028sep\u0085nel",
    # digits and numbers
    "12345 3.14159 1,000,000",
    "0123456789 9876543210 12 123 1234",
    "١٢٣ ٤٥٦ ½ ² Ⅻ ³⁄₄",
    # scripts
    "你好，世界。日本語のテキスト",
    "안녕하세요 세계",
    "Привет мир Γειά σου κόσμε مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก",
    # emoji
    "👋🌍 🎉 emoji",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag",
    "🇫🇷🇯🇵🇺🇸 flags",
    # accents
    "café naïve Ångström œuvre",
    "e\u0301 n\u0303 A\u030a (combining marks)",
    # contractions
    "I'm don't they'll we've she'd it's",
    "I'M DON'T THEY'LL WE'VE SHE'D IT'S rock'n'roll ''quoted''",
    # code
    'fn main() {\n    let name = "world";\n    println!("Hello, {}!", name);\n}\n',
    "def f(x):\n\tif x <= 2 and x != 3:\n\t\treturn x ** 2  # square\n\treturn [i for i in range(x)]\n",
    "x += 1; y <= 2 && z != 3 || w >= 4 -> a::b<T>::c()",
    # special tokens in text
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<start_of_turn>model\nHello!<end_of_turn>\n<eos>",
    "text<|endoftext|>more",
    "<table><tr><td>x</td></tr></table> <b>bold</b> </s>",
    "<bos>x<unused0>",
    # odd bytes
    "a\x00b\x1bc\x7fd",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa !!!!!!!!!! ..........",
    # empty
    "",
]

# Real prose: paragraphs of the GPL-3.0 excerpt in the repository, then the whole excerpt.
prose = open(prose_file, encoding="utf-8").read()
paragraphs = [p for p in prose.split("\n\n") if p.strip()]
texts += paragraphs[3:13]
texts.append(prose)

def tokenize(model, text):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        r = subprocess.run([tool, "-m", model, "-f", path, "--ids", "--log-disable", "--no-escape"],
                           capture_output=True, check=True)
    finally:
        os.unlink(path)
    line = r.stdout.decode().strip().splitlines()[-1]
    return json.loads(line)

cases = []
for name, model in (("smollm2", smollm2), ("gemma3", gemma3)):
    for text in texts:
        cases.append({"model": name, "text": text, "ids": tokenize(model, text)})

doc = {
    "llama_cpp": version,
    "command": "llama-tokenize -m MODEL -f TEXT_FILE --ids --log-disable --no-escape (scripts/golden_tokenize.sh)",
    "cases": cases,
}
# one case per line keeps the file small and diffs readable
with open(out, "w", encoding="utf-8") as f:
    f.write("{\n")
    for key in ("llama_cpp", "command"):
        f.write(f" {json.dumps(key)}: {json.dumps(doc[key], ensure_ascii=False)},\n")
    f.write(' "cases": [\n')
    f.write(",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases))
    f.write("\n ]\n}\n")
print(f"{out}: {len(cases)} cases")
PY
