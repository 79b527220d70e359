#!/usr/bin/env python3
"""A bounded load test of an OpenAI-compatible server (ours or llama-server).

N requests from C concurrent clients over loopback, mixed: chat and plain
completions, streaming and not; every K-th streaming request is cancelled by
its client after two content chunks. Every request must end as a complete
answer (finish_reason and usage), a client-side cancel, or a clean HTTP error
with an OpenAI error object; anything else is counted as lost. A 503 (queue
full) is retried after its Retry-After, up to --retries times. Prints JSON:
outcomes, time to first token (streams) p50/p99, and tokens/s.

Standard library only, so it runs wherever the server does.
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

PROMPTS = [
    "Name three rivers in Europe.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Give me a word that rhymes with light.",
    "Why is the sky blue? Answer briefly.",
    "List two colours.",
]


def one(url, i, args):
    """Runs request i, retrying after a 503 as its Retry-After says (as
    well-behaved clients do); returns a dict describing how it ended."""
    busy, retry_after_seen = 0, True
    while True:
        res = attempt(url, i, args)
        if res.get("status") != 503 or busy >= args.retries:
            res.update(busy=busy, retry_after_seen=retry_after_seen and (res.get("status") != 503 or bool(res.get("retry_after"))))
            return res
        busy += 1
        retry_after_seen = retry_after_seen and bool(res.get("retry_after"))
        time.sleep(float(res.get("retry_after") or 1))


def attempt(url, i, args):
    """One try of request i."""
    u = urlparse(url)
    chat = i % 2 == 0
    stream = i % 3 != 0
    cancel = stream and args.cancel_every > 0 and i % args.cancel_every == 1
    body = {"max_tokens": args.max_tokens, "temperature": 0.7, "seed": i, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        path = "/v1/completions"
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = "Bearer " + args.api_key
    if args.model:
        body["model"] = args.model
    res = {"i": i, "chat": chat, "stream": stream}
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=args.timeout)
    try:
        conn.request("POST", path, json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            data = r.read()
            try:
                err = json.loads(data)["error"]
                clean = isinstance(err, dict) and bool(err.get("message"))
            except Exception:
                clean = False
            res.update(outcome="error" if clean else "lost", status=r.status,
                       retry_after=r.getheader("Retry-After"), detail=data[:200].decode("utf-8", "replace"))
            return res
        if not stream:
            v = json.loads(r.read())
            c = v["choices"][0]
            ok = c.get("finish_reason") in ("stop", "length") and "usage" in v
            res.update(outcome="completed" if ok else "lost", tokens=v.get("usage", {}).get("completion_tokens", 0),
                       total_s=time.monotonic() - t0)
            return res
        chunks, ttft, finish, usage = 0, None, None, None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            v = json.loads(payload)
            if "error" in v:
                res.update(outcome="error", status=200, detail=str(v["error"])[:200])
                return res
            if v.get("usage"):
                usage = v["usage"]
            for c in v.get("choices", []):
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text:
                    chunks += 1
                    if ttft is None:
                        ttft = time.monotonic() - t0
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
            if cancel and chunks >= 2:
                res.update(outcome="cancelled", ttft_s=ttft)
                return res
        ok = finish in ("stop", "length") and usage is not None
        res.update(outcome="completed" if ok else "lost", ttft_s=ttft, tokens=(usage or {}).get("completion_tokens", 0),
                   total_s=time.monotonic() - t0)
        return res
    except Exception as e:  # a reset, a timeout, a malformed answer
        res.update(outcome="lost", detail=repr(e)[:200])
        return res
    finally:
        conn.close()


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cancel-every", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--retries", type=int, default=60, help="tries after a 503 before giving up")
    ap.add_argument("--api-key")
    ap.add_argument("--model")
    args = ap.parse_args()

    results, lock, next_i = [], threading.Lock(), [0]

    def client():
        while True:
            with lock:
                i = next_i[0]
                if i >= args.requests:
                    return
                next_i[0] += 1
            r = one(args.url, i, args)
            with lock:
                results.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    outcomes = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    statuses = {}
    for r in results:
        if r["outcome"] == "error":
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    ttft = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    tokens = sum(r.get("tokens", 0) for r in results if r["outcome"] == "completed")
    report = {
        "requests": args.requests,
        "answered": len(results),
        "outcomes": outcomes,
        "error_statuses": statuses,
        "busy_answers_503": sum(r["busy"] for r in results),
        "retry_after_on_503": all(r["retry_after_seen"] for r in results),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0,
        "lost_examples": [r for r in results if r["outcome"] == "lost"][:3],
    }
    print(json.dumps(report))
    return 0 if outcomes.get("lost", 0) == 0 and len(results) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
