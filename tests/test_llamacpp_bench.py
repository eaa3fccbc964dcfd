"""`python -m dflash_jax.bench.llamacpp` end to end with a stand-in for llama.cpp's interpreter: the child gets the
shipped GGUF, the threads, the budget and the same prompt ids this project decodes, and the printed line carries the
ratios computed from both sides' rates. (llama-cpp-python itself is the outside reference, never a dependency.)"""

from __future__ import annotations

import json
import sys

import numpy as np

from dflash_jax.bench import llamacpp
from dflash_jax.io import shipped

STAND_IN = """#!{python}
import json, sys
# called as: <interpreter> -c <code> <gguf> <threads> <new tokens> <json prompts>
gguf, threads, new, prompts = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])
open({log!r}, "w").write(json.dumps(dict(gguf=gguf, threads=threads, new=new, prompts=prompts)))
print(json.dumps({{"version": "stand-in", "rows": [{{"tokens": p[-1:] * new, "tokens_per_s": 50.0}} for p in prompts]}}))
"""


def test_the_command_runs_both_sides_on_the_same_prompts(tmp_path, capsys):
    log = tmp_path / "child.json"
    exe = tmp_path / "python"
    exe.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    exe.chmod(0o755)
    out = llamacpp.main(["--prompts", "2", "--new-tokens", "6", "--threads", "2", "--llama-python", str(exe)])
    child = json.loads(log.read_text())
    assert child["gguf"] == str(shipped.smollm2_path()) and child["threads"] == 2 and child["new"] == 6
    assert len(child["prompts"]) == 3 and child["prompts"][0] == child["prompts"][1]  # a warm-up run first
    assert out["llama_cpp_version"] == "stand-in" and out["llama_cpp_tokens_per_s"] == 50.0
    # (a 6-token decode on a busy machine can time as nan: prefill's rerun outlasting the loop; the ratio follows)
    np.testing.assert_allclose(out["ar_vs_llama_cpp"], out["ar_tokens_per_s"] / 50.0)
    printed = capsys.readouterr().out
    assert "llama.cpp stand-in (2 threads): 50.0 tok/s" in printed and "of autoregressive" in printed
