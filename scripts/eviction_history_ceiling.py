#!/usr/bin/env python3
"""How well can a neuron cache that ranks by history do? (Table 4's context.)

For an activation trace (`leanstream-profile activations`, e.g. a tune's
DIR/work/acts), fits per-neuron next-token use probabilities on the training
split from several history states and replays the held-out split: before each
token the cache holds the top `--budget` share of all neurons by that
probability, as if any neuron could be loaded for free between tokens. No
cache ranking by the same state can miss less. States: the neuron's training
frequency (the static hot set), its last-k-token use pattern (k = 2, 3, 4, 6),
its last activation's size against the threshold (binned: a neuron just below
it is likelier to be used next than one far below), and a ridge regression
from the layer's active set at token t to t + 1.

`--lookahead` asks whether knowing the rest of the current token (the
predictor's job: it reads the layer's input) would help: the held-out split
is replayed layer by layer through a cache that holds the top `--budget`
share by P(use at the next chance | tokens since last use), hits pinned,
misses inserted or refused, as the engine's cache does, once with history
alone and once with the true active sets of the next 1, 2, 4 or all layers
of the token known (a known-active neuron is kept, a known-inactive one
waits for the next token). Slow: use `--tokens` to cut the held-out split.

Usage: scripts/eviction_history_ceiling.py ACTS_DIR [--sparsity 0.5] [--budget 0.25]
       [--lookahead [--tokens N]]
Needs numpy (`pip install numpy`). Prints one miss ratio per state.
"""
import argparse
import glob
import json

import numpy as np


def load(acts, split, thr):
    """|activation| / the layer's threshold, [token, layer * neuron] (used: >= 1)."""
    parts = []
    for shard in sorted(glob.glob(f"{acts}/{split}/shard-*")):
        a = np.load(f"{shard}/act.npy")  # [layer, token, neuron]
        parts.append(np.abs(a.astype(np.float32)) / thr[:, None, None])
    x = np.concatenate(parts, axis=1)
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


def replay(held, slots, score):
    hits = looks = 0
    for t in range(1, held.shape[0]):
        top = np.argpartition(-score(t - 1), slots)[:slots]
        hits += held[t, top].sum()
        looks += held[t].sum()
    return 1 - hits / looks


def state_miss(train, held, freq, slots, n_states, first, train_state, held_state):
    """Free-reload miss ratio of ranking each neuron by P(used at t + 1 | its
    state at t), counted on the training tokens from `first` on ([`use_rates`])."""
    idx = np.arange(train.shape[1])
    prob = use_rates(train, freq, n_states, first, train_state)
    return replay(held, slots, lambda t: prob[idx, held_state(t)])


def use_rates(train, freq, n_states, first, state):
    """Per neuron and state, the rate of use at t + 1 over the training tokens
    t from `first` on (`state(t)` is called for each t in order), shrunk (4
    pseudo-counts) toward the neuron's frequency times the state's rate over
    all neurons."""
    neurons = train.shape[1]
    idx = np.arange(neurons)
    seen = np.zeros((neurons, n_states))
    used = np.zeros((neurons, n_states))
    for t in range(first, train.shape[0] - 1):
        s = state(t)
        np.add.at(seen, (idx, s), 1)
        np.add.at(used, (idx, s), train[t + 1])
    rate = used.sum(0) / np.maximum(seen.sum(0), 1)
    prior = np.clip(freq[:, None] * rate[None, :] / freq.mean(), 0, 1)
    return (used + 4 * prior) / (seen + 4)


AGE_EDGES = np.array([1, 2, 3, 5, 9, 17, 33])  # tokens since last use, bucket edges


def age_prob(train):
    """P(used at t + 1 | tokens since last use at t), per neuron and age bucket."""
    last = np.full(train.shape[1], -(10**6))

    def age_bucket(t):
        last[train[t]] = t
        return np.searchsorted(AGE_EDGES, t - last, side="right")

    return use_rates(train, train.mean(0), len(AGE_EDGES) + 1, 0, age_bucket)


def layer_replay(held, n_layer, n_ff, slots, prob, lookahead):
    """Miss ratio of the layer-by-layer replay with an exact-priority cache;
    the true active sets of the next `lookahead` layers of each token known."""
    neurons = held.shape[1]
    idx = np.arange(neurons)
    layer_of = idx // n_ff
    cache = np.zeros(neurons, bool)
    last = np.full(neurons, -(10**6))
    hits = looks = 0
    for t in range(held.shape[0]):
        for layer in range(n_layer):
            cols = slice(layer * n_ff, (layer + 1) * n_ff)
            need = np.zeros(neurons, bool)
            need[cols] = held[t, cols]
            hit = cache & need
            hits += hit.sum()
            looks += need.sum()
            last[need] = t
            # Later layers of this token still get their chance: one missed fewer.
            age = np.where(layer_of > layer, np.maximum(t - last - 1, 0), t - last)
            p = prob[idx, np.searchsorted(AGE_EDGES, age, side="right")]
            for ahead in range(layer + 1, min(layer + 1 + lookahead, n_layer)):
                c = slice(ahead * n_ff, (ahead + 1) * n_ff)
                later = prob[idx[c], np.searchsorted(AGE_EDGES, age[c] + 1, side="right")]
                p[c] = np.where(held[t, c], 2.0, later)
            # What competes for the unpinned slots: residents not needed now, and misses.
            rivals = np.flatnonzero(cache ^ need)
            room = slots - hit.sum()
            keep = rivals[np.argpartition(-p[rivals], room)[:room]] if len(rivals) > room else rivals
            cache[:] = False
            cache[hit] = True
            cache[keep] = True
    return 1 - hits / looks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("acts")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--lookahead", action="store_true")
    ap.add_argument("--tokens", type=int, help="held-out tokens the layer replay takes")
    a = ap.parse_args()
    m = json.load(open(f"{a.acts}/manifest.json"))
    level = [lv for lv in m["levels"] if abs(lv["sparsity"] - a.sparsity) < 1e-6]
    if not level:
        raise SystemExit(f"{a.acts}/manifest.json: no thresholds for sparsity {a.sparsity}")
    thr = np.array(level[0]["per_layer"], dtype=np.float32)
    train_size, held_size = load(a.acts, "train", thr), load(a.acts, "heldout", thr)
    train, held = train_size >= 1, held_size >= 1
    n_layer, n_ff = m["model"]["n_layer"], m["model"]["n_ff"]
    neurons = train.shape[1]
    slots = int(a.budget * neurons)
    freq = train.mean(0)
    if a.lookahead:
        prob = age_prob(train)
        part = held[: a.tokens]
        print(f"layer replay over {part.shape[0]} held-out tokens")
        for k in (0, 1, 2, 4, n_layer):
            miss = layer_replay(part, n_layer, n_ff, slots, prob, k)
            print(f"  next {k} layers known: {miss:.4f}" if k else f"  history alone: {miss:.4f}", flush=True)
        return
    print(f"hot (training frequency): {replay(held, slots, lambda t: freq):.4f}")
    for k in (2, 3, 4, 6):
        weights = 1 << np.arange(k)

        def pattern(x, t):
            window = x[max(0, t - k + 1): t + 1][::-1]
            return (window * weights[: window.shape[0], None]).sum(0)

        miss = state_miss(train, held, freq, slots, 1 << k, k, lambda t: pattern(train, t), lambda t: pattern(held, t))
        print(f"last {k} tokens' use pattern: {miss:.4f}")
    edges = np.array([0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5], dtype=np.float32)

    def size_bin(x, t):
        return np.searchsorted(edges, x[t], side="right")

    miss = state_miss(
        train, held, freq, slots, len(edges) + 1, 0, lambda t: size_bin(train_size, t), lambda t: size_bin(held_size, t)
    )
    print(f"last activation's size against the threshold: {miss:.4f}")
    score = np.zeros((held.shape[0], neurons), dtype=np.float32)
    for layer in range(n_layer):
        cols = slice(layer * n_ff, (layer + 1) * n_ff)
        x = np.concatenate([train[:-1, cols], np.ones((train.shape[0] - 1, 1))], 1).astype(np.float32)
        w = np.linalg.solve(x.T @ x + 10 * np.eye(n_ff + 1, dtype=np.float32), x.T @ train[1:, cols])
        xh = np.concatenate([held[:, cols], np.ones((held.shape[0], 1))], 1).astype(np.float32)
        score[:, cols] = xh @ w
    print(f"ridge regression from the layer's active set: {replay(held, slots, lambda t: score[t]):.4f}")


if __name__ == "__main__":
    main()
