# Simulated tau of draft trees (DDTree best-first over the drafter's top-4 per position) with context lookup policies
# (drafts.json from collect_drafts.py: run from the repository root, then this from the folder holding drafts.json)
import json, heapq, numpy as np
data = json.load(open("drafts.json"))
def lookup_k(seq, t, D, kmax=6):
    for k in range(kmax, 0, -1):
        if t - k + 1 < 0: continue
        pat = seq[t - k + 1:t + 1]
        for j in range(t - 1, k - 2, -1):
            if seq[j - k + 1:j + 1] == pat:
                return k, seq[j + 1:min(j + 1 + D, t + 1)]
    return 0, []
def ddtree_list(ids, lps, N):
    """The N best prefixes in pop order: best-first over sums of per-depth log-probs, top-K = min(N, 4) per depth."""
    D = min(N, 7); K = min(N, 4)
    nodes = []; heap = [(-lps[0][0], (0,))]
    while heap and len(nodes) < N:
        negs, ranks = heapq.heappop(heap)
        nodes.append(tuple(ids[d][r] for d, r in enumerate(ranks)))
        d = len(ranks) - 1
        if ranks[-1] + 1 < K:
            heapq.heappush(heap, (negs + lps[d][ranks[-1]] - lps[d][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
        if d + 1 < D:
            heapq.heappush(heap, (negs - lps[d + 1][0], ranks + (0,)))
    return nodes
def ddtree(ids, lps, N):
    return set(ddtree_list(ids, lps, N))
def accepted(nodes, seq, t):
    a = 0
    while t + 1 + a < len(seq) and tuple(seq[t + 1:t + 2 + a]) in nodes: a += 1
    return a
def sim(policy):
    steps = toks = 0
    for row in data:
        seq, P, dr = row["seq"], row["P"], row["draft"]
        t = P
        while t < len(seq) - 1:
            ids, lps = dr[t - P]
            a = accepted(policy(seq, t, ids, lps), seq, t)
            steps += 1; toks += a + 1; t += a + 1
    return toks / steps
def chain(toks): return {tuple(toks[:i + 1]) for i in range(len(toks))}
for N in (1, 2, 3, 4, 7, 8):
    base = sim(lambda s, t, i, l: ddtree(i, l, N))
    res = [f"N{N}: ddtree {base:.3f}"]
    for kthr in (2, 3, 4):
        def pol(s, t, i, l, kthr=kthr):
            k, prop = lookup_k(s, t, N)
            if k >= kthr and prop:
                nodes = chain(prop)
                if len(nodes) < N:  # fill with the drafter's best-first nodes not already there
                    for nd in sorted(ddtree(i, l, N), key=len):
                        if len(nodes) >= N: break
                        if nd not in nodes and (len(nd) == 1 or nd[:-1] in nodes): nodes.add(nd)
                return nodes
            return ddtree(i, l, N)
        res.append(f"adaptive k>={kthr} {sim(pol):.3f}")
    for L in (1, 2, 3):
        if L >= N: continue
        def pol2(s, t, i, l, L=L):
            k, prop = lookup_k(s, t, L)
            return ddtree(i, l, N - L) | (chain(prop) if k >= 2 else set())
        res.append(f"split {N-L}+L{L} {sim(pol2):.3f}")
    print("  ".join(res), flush=True)
print("variants")
for N in (1, 2, 3, 4, 7):
    res = [f"N{N}"]
    for kthr in (1, 2, 3):
        def v1(s, t, i, l, kthr=kthr):
            k, prop = lookup_k(s, t, N)
            return chain(prop) if k >= kthr and prop else ddtree(i, l, N)
        def v2(s, t, i, l, kthr=kthr):
            k, prop = lookup_k(s, t, N)
            if k >= kthr and prop:
                return chain(prop) | set(ddtree_list(i, l, N)[:N - len(prop)])
            return ddtree(i, l, N)
        res.append(f"k>={kthr}: chain-only {sim(v1):.3f} union-first {sim(v2):.3f}")
    print("  ".join(res), flush=True)
