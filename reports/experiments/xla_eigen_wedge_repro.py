"""Reproduces the stall of 2026-12-05's CI run outside pytest: one process computing tests/test_hybrid.py's `sampled`
fixture forward (a random Qwen3.5-style hybrid target over all 32,768 continuations) again and again. When one
forward takes over 60 s the process writes `hung_<pid>` next to this file and waits for it to be removed, so a
debugger can attach from outside (from inside, gdb deadlocked):

    # shell 1, from the repository root; 2-3 copies at once make it likelier (it stalled 4 times in 18 x 30 forwards
    # and 2 in 42 x 40 while the 2 cores were loaded, never on a quiet machine):
    XLA_FLAGS="" python reports/experiments/xla_eigen_wedge_repro.py 40
    # shell 2: for f in reports/experiments/hung_*; do gdb -p ${f##*_} -batch -ex "thread apply all bt"; rm $f; done

XLA_FLAGS=--xla_cpu_multi_thread_eigen=false (single-threaded Eigen, which ended a similar stall for PyAutoFit,
issues #1528 / #1530) did not end this one: a fresh-clone CI run with the suite under that flag stalled in
tests/test_hybrid.py's sampled test all the same (2026-12-05).

Cause (2026-12-05, fourth session; README.md beside this file): two LAPACK trsm FFI calls of the delta rule, each
waiting inside XLA's 2-thread intra-op pool for tasks it had queued on that pool. Since `deltanet.unit_lower_inverse`
replaced them, this script no longer stalls on the current code; check out a commit before that to reproduce.
"""
import itertools
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import dflash_jax as dj  # noqa: E402
import test_hybrid as th  # noqa: E402

HERE = Path(__file__).resolve().parent
last = [time.time()]


def watchdog():
    while True:
        time.sleep(5)
        if time.time() - last[0] > 60:
            marker = HERE / f"hung_{os.getpid()}"
            print("stalled; attach to", os.getpid(), flush=True)
            marker.write_text("")
            while marker.exists():
                time.sleep(1)
            os._exit(3)


threading.Thread(target=watchdog, daemon=True).start()
ts, target, _ = th._sampled_pair()
ids = np.asarray([ts.PROMPT + list(c) for c in itertools.product(range(ts.V), repeat=ts.L)], np.int32)
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    last[0] = time.time()
    np.asarray(dj.target_forward(target, ids)[0])
print("no stall in", it + 1, "forwards", flush=True)
