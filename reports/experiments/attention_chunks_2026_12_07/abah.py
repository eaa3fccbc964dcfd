# python abah.py ROUNDS BIN0 BIN1 ...: each binary runs each config in turn; paired median ratios to BIN0
import subprocess, sys, statistics, collections
rounds = int(sys.argv[1]); bins = sys.argv[2:]
configs = ["1 150", "3 150", "4 512", "1 1024", "4 1024"]
res = collections.defaultdict(list)
for r in range(rounds):
    for c in configs:
        for b in (bins if r % 2 == 0 else bins[::-1]):
            out = subprocess.run(['./' + b] + c.split(), capture_output=True, text=True).stdout
            res[(b, c)].append(float(out.split(':')[1].split()[0]))
for c in configs:
    parts = []
    for b in bins:
        ratios = [x / y for x, y in zip(res[(b, c)], res[(bins[0], c)])]
        parts.append(f"{b} {statistics.median(res[(b, c)]):.0f}us ({statistics.median(ratios):.3f})")
    print(f"T,L={c}: " + " | ".join(parts))
