# python ab_drive.py ROUNDS REQUESTS TREE_A TREE_B: ab_one.py run from each tree in turn (alternating which goes
# first), ROUNDS times; per setting, medians and the paired median of B / A over the same requests.
import json, os, statistics, subprocess, sys
trees = sys.argv[3:]; rounds = int(sys.argv[1]); n = sys.argv[2]
res = {t: [] for t in trees}
for r in range(rounds):
    for t in (trees if r % 2 == 0 else trees[::-1]):
        out = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ab_one.py"), n], cwd=t, capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
        if not line: print(out.stderr[-3000:]); sys.exit(1)
        d = json.loads(line[0][7:]); res[t].append(d); print(t, r, d["hash"], d["same"], {k: round(statistics.median(v), 1) for k, v in d["tps"].items()}, flush=True)
a, b = trees
for k in res[a][0]["tps"]:
    ta = [x for d in res[a] for x in d["tps"][k]]; tb = [x for d in res[b] for x in d["tps"][k]]
    print(f"{k}: {a} {statistics.median(ta):.1f} tok/s, {b} {statistics.median(tb):.1f} tok/s, paired {b}/{a} {statistics.median([y / x for x, y in zip(ta, tb)]):.3f}")
