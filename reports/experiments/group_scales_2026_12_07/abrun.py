# python abrun.py ROUNDS BASE_BINARY OTHER_BINARIES...: mbq.cc builds run in turn, ROUNDS times; per row count the
# median of their per-run minimum times and the paired median ratio to the first binary.
import subprocess, sys, statistics, re, collections
bins = sys.argv[2:]; rounds = int(sys.argv[1])
res = collections.defaultdict(lambda: collections.defaultdict(list))
for r in range(rounds):
    for b in bins:
        out = subprocess.run(['./' + b], capture_output=True, text=True).stdout
        last = {}
        for line in out.splitlines():
            m = re.match(r"f32 M=(\d+): median [\d.]+ ms min ([\d.]+)", line)
            if m: last[int(m.group(1))] = float(m.group(2))
        for M, t in last.items(): res[b][M].append(t)
base = bins[0]
for b in bins:
    parts = []
    for M in sorted(res[b]):
        ratios = [x / y for x, y in zip(res[b][M], res[base][M])]
        parts.append(f"M={M} {statistics.median(res[b][M]):.3f} ms ({statistics.median(ratios):.3f})")
    print(b, ' | '.join(parts))
