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

Usage: scripts/eviction_history_ceiling.py ACTS_DIR [--sparsity 0.5] [--budget 0.25]
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
    state at t), counted on the training tokens from `first` on; each
    neuron's rate in a state is shrunk (4 pseudo-counts) toward its training
    frequency scaled by that state's rate over all neurons."""
    neurons = train.shape[1]
    idx = np.arange(neurons)
    seen = np.zeros((neurons, n_states))
    used = np.zeros((neurons, n_states))
    for t in range(first, train.shape[0] - 1):
        s = train_state(t)
        np.add.at(seen, (idx, s), 1)
        np.add.at(used, (idx, s), train[t + 1])
    rate = used.sum(0) / np.maximum(seen.sum(0), 1)
    prior = np.clip(freq[:, None] * rate[None, :] / freq.mean(), 0, 1)
    prob = (used + 4 * prior) / (seen + 4)
    return replay(held, slots, lambda t: prob[idx, held_state(t)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("acts")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--budget", type=float, default=0.25)
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
