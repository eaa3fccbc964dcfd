# Simulated tau of chains: the drafter's, the context lookup's, their union (drafts.json from collect_drafts.py)
import json, numpy as np
data = json.load(open("drafts.json"))
for row in data:  # the drafter's greedy chain at every anchor: each position's top token
    row["draft"] = [[ids[0] for ids in d[0]] for d in row["draft"]]
def acc(prop, seq, t):
    a = 0
    for i, x in enumerate(prop):
        if t + 1 + i < len(seq) and seq[t + 1 + i] == x: a += 1
        else: break
    return a
def lookup(seq, t, D, kmin=1, kmax=4):
    for k in range(kmax, kmin - 1, -1):
        if t - k + 1 < 0: continue
        pat = seq[t - k + 1:t + 1]
        for j in range(t - 1, k - 2, -1):
            if seq[j - k + 1:j + 1] == pat:
                return seq[j + 1:min(j + 1 + D, t + 1)]
    return []
def sim(policy):
    steps = toks = 0
    for row in data:
        seq, P, dr = row["seq"], row["P"], row["draft"]
        t = P
        while t < len(seq) - 1:
            a = policy(seq, t, dr[t - P])
            a = min(a, len(seq) - 1 - t)
            steps += 1; toks += a + 1; t += a + 1
    return toks / steps
for D in (1, 3, 7):
    print(f"D{D}: drafter {sim(lambda s, t, d: acc(d[:D], s, t)):.3f}  lookup(k1-4) {sim(lambda s, t, d: acc(lookup(s, t, D), s, t)):.3f}"
          f"  lookup(k2-4) {sim(lambda s, t, d: acc(lookup(s, t, D, 2), s, t)):.3f}"
          f"  union {sim(lambda s, t, d: max(acc(d[:D], s, t), acc(lookup(s, t, D), s, t))):.3f}"
          f"  union(k2) {sim(lambda s, t, d: max(acc(d[:D], s, t), acc(lookup(s, t, D, 2), s, t))):.3f}")
# drafter D3 + lookup of length L
for D, L in ((1, 3), (2, 3), (3, 3), (3, 7), (1, 7)):
    print(f"drafter D{D} + lookup L{L}: {sim(lambda s, t, d: max(acc(d[:D], s, t), acc(lookup(s, t, L), s, t))):.3f}")
# accuracy of the lookup's first token by the matched context length k, and of the drafter's first token then
import collections
def lookup_k(seq, t, D, kmax=6):
    for k in range(kmax, 0, -1):
        if t - k + 1 < 0: continue
        pat = seq[t - k + 1:t + 1]
        for j in range(t - 1, k - 2, -1):
            if seq[j - k + 1:j + 1] == pat:
                return k, seq[j + 1:min(j + 1 + D, t + 1)]
    return 0, []
st = collections.defaultdict(lambda: [0, 0, 0, 0])
for row in data:
    seq, P, dr = row["seq"], row["P"], row["draft"]
    for t in range(P, len(seq) - 1):
        k, prop = lookup_k(seq, t, 7)
        s = st[k]; s[0] += 1; s[1] += acc(prop, seq, t) >= 1; s[2] += acc(dr[t - P][:1], seq, t) >= 1; s[3] += acc(prop, seq, t)
for k in sorted(st):
    n, l1, d1, la = st[k]
    print(f"k={k}: n {n}, lookup slot1 {l1/n:.2f}, drafter slot1 {d1/n:.2f}, lookup mean accepted {la/n:.2f}")
