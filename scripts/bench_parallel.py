#!/usr/bin/env python3
"""Aggregate decode throughput of an OpenAI-compatible server (ours or
llama-server) with C concurrent clients.

Each round, C clients start at once and each streams one greedy completion
of MAX_TOKENS tokens after its own window of real prose (taken from --text,
a different window per client and round). Prints JSON: completion tokens,
wall seconds, aggregate tokens/s (all tokens of the round over its wall
time), decode tokens/s (tokens after the first over the time from the
round's first token to its last), and time to first token p50/p99.

Standard library only, so it runs wherever the server does.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
from urllib.parse import urlparse


def windows(path, n, words):
    """n windows of `words` words of the text at `path`, spread over it."""
    text = open(path, encoding="utf-8").read().split()
    step = max(1, (len(text) - words) // max(1, n))
    return [" ".join(text[i * step:i * step + words]) for i in range(n)]


def one(url, prompt, max_tokens, model, start):
    """Streams one completion once `start` is set; returns (tokens, t_first, t_end)."""
    u = urlparse(url)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    start.wait()
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first, usage, chunks = None, None, 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        v = json.loads(payload)
        if v.get("usage"):
            usage = v["usage"]
        for c in v.get("choices", []):
            if c.get("text"):
                chunks += 1
                if first is None:
                    first = time.monotonic()
    end = time.monotonic()
    conn.close()
    tokens = (usage or {}).get("completion_tokens") or chunks
    return tokens, t0, first or end, end


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--text", default="data/text/gpl-3.0.txt")
    ap.add_argument("--words", type=int, default=48)
    ap.add_argument("--model")
    args = ap.parse_args()

    prompts = windows(args.text, args.clients * args.rounds, args.words)
    rounds = []
    for r in range(args.rounds):
        start, results, errors = threading.Event(), [], []

        def client(p):
            try:
                results.append(one(args.url, p, args.max_tokens, args.model, start))
            except Exception as e:  # a failed request fails the benchmark
                errors.append(repr(e)[:200])

        threads = [threading.Thread(target=client, args=(prompts[r * args.clients + i],)) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        start.set()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"round {r}: {errors}")
        t0 = min(x[1] for x in results)
        first = min(x[2] for x in results)
        end = max(x[3] for x in results)
        tokens = sum(x[0] for x in results)
        rounds.append({
            "tokens": tokens,
            "wall_s": end - t0,
            "tok_s": tokens / (end - t0),
            "decode_tok_s": (tokens - len(results)) / max(1e-9, end - first),
            "ttft_s": [x[2] - x[1] for x in results],
        })
    ttft = [t for r in rounds for t in r["ttft_s"]]
    print(json.dumps({
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tokens": sum(r["tokens"] for r in rounds),
        "tok_s": statistics.median(r["tok_s"] for r in rounds),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rounds),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
    }))


if __name__ == "__main__":
    main()
