"""Evaluates tree_scores_data.py's anchors: calibration tables, chain and tree tau with raw and calibrated scores."""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).parent))
from tree_scores_data import tree_accept, chain_accept, calibration, K
z = np.load(Path(__file__).with_name("tree_scores_data.npz"))
tr = [z[f"arr_{i}"] for i in range(4)]; ev = [z[f"arr_{i}"] for i in range(4, 8)]
D = tr[0].shape[1]
edges = np.array([-np.inf, -8, -6, -5, -4, -3, -2.5, -2, -1.5, -1, -0.7, -0.5, -0.3, -0.15, -0.05, 0.01])
cal = calibration(*tr, edges)
print("match rate of a depth's top-K tokens per depth (rows) and bin of the drafter's log q (columns: upper edges)", [f"{e:.2f}" for e in edges[1:]])
for d in range(D):
    print(d + 1, " ".join(f"{m/c if c else float('nan'):.2f}({int(c)})" for m, c in cal[d]))
# mean q of top-1 vs its match rate per depth
for name, (lp, ids, lab, val) in (("train", tr), ("eval", ev)):
    print(name, "top1 mean q vs match per depth:", [(round(float(np.exp(lp[val[:, d], d, 0]).mean()), 3),
           round(float((ids[val[:, d], d, 0] == lab[val[:, d], d]).mean()), 3)) for d in range(D)])
# the chain's top-1 match at depth d given every earlier depth matched, against its marginal match rate
for name, (lp, ids, lab, val) in (("train", tr), ("eval", ev)):
    m = (ids[:, :, 0] == lab) & val
    prefix = np.cumprod(m, axis=1)
    cond = [float(m[:, 0].mean())] + [float(m[prefix[:, d - 1] > 0, d].mean()) for d in range(1, D)]
    print(name, "top-1 match given the earlier depths matched:", [round(c, 3) for c in cond],
          "| marginal:", [round(float(m[val[:, d], d].mean()), 3) for d in range(D)])
# calibrated table: per depth, per bin, log(match rate) (monotone non-decreasing in bin, <= 0), from train
table = np.zeros((D, len(edges) - 1))
for d in range(D):
    rate = (cal[d, :, 0] + 0.5) / (cal[d, :, 1] + 1.0)
    rate = np.maximum.accumulate(rate)  # monotone in q
    table[d] = np.log(np.minimum(rate, 1.0))
def raw(d, x): return x
def calibrated(d, x):
    b = int(np.clip(np.digitize(x, edges) - 1, 0, len(edges) - 2)); return table[d - 1, b]
def lin(a):
    return lambda d, x: a[d - 1] * x + b_[d - 1]
def evaluate(data, N, score):
    lp, ids, lab, val = data
    return 1 + np.mean([tree_accept(lp[i], ids[i], lab[i], val[i], N, score) for i in range(len(lp))])
for name, data in (("train", tr), ("eval", ev)):
    chains = [1 + np.mean([chain_accept(data[1][i], data[2][i], data[3][i], Dd) for i in range(len(data[0]))]) for Dd in (1, 2, 3, 4, 7)]
    print(name, "chain tau D 1/2/3/4/7:", [round(float(c), 3) for c in chains])
    for N in (2, 3, 4, 8, 16):
        print(name, f"tree {N}: raw {evaluate(data, N, raw):.3f} calibrated {evaluate(data, N, calibrated):.3f}", flush=True)

print("--- conditional on the true prefix being a tree path (labels at earlier depths within the top-K)")
def calibration_cond(lp, ids, lab, val, edges, topk=K):
    D = lp.shape[1]
    out = np.zeros((D, len(edges) - 1, 2))
    inK = np.array([[val[i, d] and lab[i, d] in ids[i, d, :topk] for d in range(D)] for i in range(len(lp))])
    ok = np.ones(len(lp), bool)
    for d in range(D):
        v = val[:, d] & ok
        for r in range(K):
            x = lp[v, d, r]; m = ids[v, d, r] == lab[v, d]
            b = np.clip(np.digitize(x, edges) - 1, 0, len(edges) - 2)
            np.add.at(out[d, :, 0], b, m); np.add.at(out[d, :, 1], b, 1)
        ok = ok & inK[:, d]
    return out
for topk in (1, 2, K):
    calc = calibration_cond(*tr, edges, topk)
    table = np.zeros((D, len(edges) - 1))
    for d in range(D):
        rate = (calc[d, :, 0] + 0.5) / (calc[d, :, 1] + 1.0)
        rate = np.maximum.accumulate(rate)
        table[d] = np.log(np.minimum(rate, 1.0))
    print("prefix within top", topk, "top1 rows per depth:", [round(float(np.exp(table[d, -4])), 2) for d in range(D)])
    def cond(d, x, table=table):
        b = int(np.clip(np.digitize(x, edges) - 1, 0, len(edges) - 2)); return table[d - 1, b]
    for name, data in (("train", tr), ("eval", ev)):
        print(name, "cond", topk, " ".join(f"tree {N}: {evaluate(data, N, cond):.3f}" for N in (2, 3, 4, 8, 16)), flush=True)
