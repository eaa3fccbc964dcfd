"""Offline: the shipped drafter's per-depth calibration, and draft trees built from its raw scores (DDTree's sum of
log-probabilities) against calibrated ones, scored by the target's greedy continuations at many anchors of greedy
answers. Collects the data (train split: 48 requests; eval split: 32), then `tree_scores_eval.py` evaluates.

    python reports/experiments/tree_scores_bf16_default_2026_12_08/tree_scores_data.py 48 32   # ~3 min, 2 cores
    python reports/experiments/tree_scores_bf16_default_2026_12_08/tree_scores_eval.py          # ~1 min
"""
import sys, json, heapq, time
from pathlib import Path
import numpy as np, jax, jax.numpy as jnp
from dflash_jax.io.shipped import load_default
from dflash_jax.train.drafter_data import chat_prompt_ids, make_sequences, target_features, sample_anchors
from dflash_jax.train.drafter_loss import training_logits, training_labels

K = 8
def collect(target, drafter, tok, split, n, seed, anchors_per_row=48):
    prompts = chat_prompt_ids(tok, n, split=split, seed=seed, max_prompt_tokens=160)
    seq_len = max(len(p) for p in prompts) + 128
    data = make_sequences(target, prompts, max_new_tokens=128, seq_len=seq_len, sampled_fraction=0.0, batch=n,
                          eos_ids=(tok.eos_id,))
    cfg = drafter.config
    feats = target_features(target, data["tokens"], cfg.target_layer_ids, batch=8)
    rng = np.random.default_rng(seed)
    lps, ids, labs, vals = [], [], [], []
    f = jax.jit(lambda p, b: training_logits(p, b, cfg, target.config))
    for i in range(0, n, 4):
        idx = np.arange(i, min(i + 4, n))
        anchors, keep = sample_anchors(data["lengths"][idx], data["prompt_lens"][idx], anchors_per_row, rng)
        batch = {"tokens": jnp.asarray(data["tokens"][idx]), "lengths": jnp.asarray(data["lengths"][idx]),
                 "anchors": jnp.asarray(anchors), "keep": jnp.asarray(keep), "target": target.params,
                 "features": jnp.asarray(feats[idx])}
        logits = f(drafter.params, batch)  # [B, N, bs-1, V]
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        v, t = jax.lax.top_k(lp, K)
        labels, valid = training_labels(batch, cfg.block_size)
        kk = np.asarray(keep)
        lps.append(np.asarray(v)[kk]); ids.append(np.asarray(t)[kk]); labs.append(np.asarray(labels)[kk])
        vals.append(np.asarray(valid)[kk])
    return np.concatenate(lps), np.concatenate(ids), np.concatenate(labs), np.concatenate(vals)

def tree_accept(lp, ids, lab, val, N, score):
    """accepted depth of a best-first tree of N nodes under score(depth, lp) (depth 1-based)"""
    D = lp.shape[0]
    heap = [(-score(1, lp[0, 0]), 0, 1, 0, 0.0)]  # (-s, counter, depth, rank, parent_score) ; parent path id
    nodes = []  # (depth, rank, parent_index)
    # parent tracked by index
    heap = [(-score(1, lp[0, 0]), 0, 1, 0, -1, 0.0)]
    cnt = 1
    while heap and len(nodes) < N:
        ns, _, d, r, par, pscore = heapq.heappop(heap)
        s = -ns
        me = len(nodes); nodes.append((d, r, par))
        if r + 1 < K:
            heapq.heappush(heap, (-(pscore + score(d, lp[d - 1, r + 1])), cnt, d, r + 1, par, pscore)); cnt += 1
        if d < D:
            heapq.heappush(heap, (-(s + score(d + 1, lp[d, 0])), cnt, d + 1, 0, me, s)); cnt += 1
    # walk: at depth d, find child of current node with token == label
    cur, acc = -1, 0
    for d in range(1, D + 1):
        if not val[d - 1]: break
        nxt = next((i for i, (dd, r, p) in enumerate(nodes) if dd == d and p == cur and ids[d - 1, r] == lab[d - 1]), None)
        if nxt is None: break
        cur, acc = nxt, acc + 1
    return acc

def chain_accept(ids, lab, val, D):
    acc = 0
    for d in range(D):
        if not val[d] or ids[d, 0] != lab[d]: break
        acc += 1
    return acc

def calibration(lp, ids, lab, val, edges):
    """per depth, per bin of lp: (matches, count) over nodes whose prefix (labels before) the drafter's top-1 matched?
    Here: conditional on the true prefix (teacher forcing is what the block sees anyway: block positions are
    marginals), the event label == token."""
    D = lp.shape[1]
    out = np.zeros((D, len(edges) - 1, 2))
    for d in range(D):
        v = val[:, d]
        for r in range(K):
            x = lp[v, d, r]; m = ids[v, d, r] == lab[v, d]
            b = np.clip(np.digitize(x, edges) - 1, 0, len(edges) - 2)
            np.add.at(out[d, :, 0], b, m); np.add.at(out[d, :, 1], b, 1)
    return out

if __name__ == "__main__":
    target, drafter, tok = load_default()
    t0 = time.time()
    tr = collect(target, drafter, tok, "train", int(sys.argv[1]), 3)
    ev = collect(target, drafter, tok, "eval", int(sys.argv[2]), 1)
    print("collected", tr[0].shape, ev[0].shape, f"{time.time()-t0:.0f}s", flush=True)
    np.savez(str(Path(__file__).with_name("tree_scores_data.npz")), *tr, *ev)
