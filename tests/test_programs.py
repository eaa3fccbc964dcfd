"""Prefill and the generation loop as two programs, buckets, and the calling conventions.

- a new prompt-length bucket compiles a new prefill program only: 100 prompt lengths over 1..1000 -> 1 loop program;
- batches run in a batch bucket whose padding rows are inert (never in the result, never changing a real row);
- cache buckets: powers of two (at least 2048, every platform) up to 4k slots, then multiples of 1k;
- attention_mask (left / right padding) and prompt_lengths give each row what it gets alone (greedy, float32);
- return_prompt and GenerationResult.decode; a SamplingParams object == the keywords; EOS from the config by default.
"""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

import dflash_jax as dj
from random_models import make_drafter, make_target
from dflash_jax.config import DrafterConfig, TargetConfig

G = importlib.import_module("dflash_jax.decode.programs")

# A config of its own (vocab 76), so that the jit caches start empty for it.
CFG = TargetConfig(vocab_size=76, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                  max_position_embeddings=4096)
DCFG = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=75, target_layer_ids=(0, 1),
                     num_target_layers=2)
NEW = 12


@pytest.fixture(scope="module")
def pair():
    return make_target(CFG, 0), make_drafter(DCFG, 1)


def _rows(seed, lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 74, n).tolist() for n in lens]


def _alone(fn, rows, **kw):
    """Each row run on its own (batch 1): the reference a batched call must equal."""
    return [fn([r], **kw).token_lists()[0] for r in rows]


# -- programs: prefill apart from the loop ---------------------------------------------------------------------------

def test_prompt_lengths_compile_prefill_only(pair, monkeypatch):
    """23 prompt lengths over 1..1000 (both edges and the middle of each of the 7 prompt buckets): 7 prefill
    programs, 1 loop program, on CPU as on accelerators (one 2048-slot minimum cache bucket; CPU's attention visits
    only the live blocks of it); a later call with a new prompt bucket traces prefill again and not the loop."""
    monkeypatch.setattr(G, "_COMPILED", {})  # fresh jit caches: the counts below are this test's compiles
    target, drafter = pair
    before = dict(G.TRACE_COUNTS)
    lens = np.array([1, 9, 16, 17, 25, 32, 33, 50, 64, 65, 100, 128, 129, 200, 256, 257, 400, 512, 513, 750, 1000,
                     999, 700])
    rng = np.random.default_rng(0)
    for n in lens:
        dj.generate(target, drafter, [rng.integers(2, 74, int(n)).tolist()], max_new_tokens=2, eos_ids=())
    traces = {k: G.TRACE_COUNTS[k] - before[k] for k in before}
    counts = G.compiled_counts()
    buckets = sorted({G.prompt_bucket(int(n)) for n in lens})
    print(f"\n[programs] {len(lens)} prompt lengths 1..1000: {counts['prefill']} prefill programs "
          f"({len(buckets)} buckets), "
          f"{counts['speculative']} loop program(s)")
    assert buckets == [16, 32, 64, 128, 256, 512, 1024]
    assert traces["speculative"] == counts["speculative"] == 1
    assert traces["prefill"] == counts["prefill"] == len(buckets)
    # the key of a loop program holds no prompt length: the cache bucket is one for this whole range
    def loop_key(n):  # the loop's static arguments + the shapes it sees (cache slots, rows)
        call = G.speculative_call(target, drafter, [[1] * int(n)], max_new_tokens=2)
        return tuple(sorted(call.loop_static.items())), call.prefill_static["cache_len"], call.args[2].shape[0]
    assert len({loop_key(n) for n in lens}) == 1
    # the accelerators' rule keys the same range by one loop program too (static trip counts: only the flag differs)
    monkeypatch.setitem(G.LIVE_LENGTH_LOOP, "cpu", False)
    assert len({loop_key(n) for n in lens}) == 1
    monkeypatch.setitem(G.LIVE_LENGTH_LOOP, "cpu", True)
    # a prompt of 1800 tokens: 1800 + 256 + 4 slots -> the next cache bucket (4096): one more loop program
    dj.generate(target, drafter, [[3] * 1800], max_new_tokens=2, eos_ids=())
    assert G.compiled_counts() == {"prefill": len(buckets) + 1, "speculative": 2, "autoregressive": 0}


def test_loop_program_has_no_host_op_and_takes_a_device_handoff(pair):
    """The loop program's jaxpr: one while loop, no host callback anywhere (prefill holds the one timing stamp)."""
    target, drafter = pair
    call = G.speculative_call(target, drafter, _rows(1, (5, 9)), max_new_tokens=NEW)
    pre = call.run_prefill()
    assert isinstance(pre, G.Prefilled) and all(isinstance(x, jax.Array) for x in jax.tree.leaves(pre))
    t, d, _, _, keys, sampling, budget = call.args
    loop = jax.make_jaxpr(lambda *a: G._speculative_loop(*a, draft_length=call.draft_length,
                                                         out_len=call.loop_static["out_len"]))(
        t, d, pre, keys, sampling, budget)
    names = [e.primitive.name for e in loop.jaxpr.eqns]
    assert names.count("while") == 1 and not [n for n in names if "callback" in n]
    pf = jax.make_jaxpr(lambda *a: G._prefill_program(*a, cache_len=call.prefill_static["cache_len"], stamp=True))(
        t, d, call.args[2], call.args[3])
    assert [e.primitive.name for e in pf.jaxpr.eqns].count("io_callback") == 1


# -- buckets -----------------------------------------------------------------------------------------------------------

def test_bucket_rules():
    assert [G.batch_bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 33)] == [1, 2, 4, 8, 16, 16, 32, 48]
    assert [G.cache_bucket(n) for n in (1, 300, 2048, 2049, 4096, 4097, 8200, 16385)] == [
        2048, 2048, 2048, 4096, 4096, 5120, 9216, 17408]
    assert [G.prompt_bucket(n) for n in (1, 17, 4096, 4097, 5000)] == [16, 32, 4096, 5120, 5120]
    # above 4k the waste is under 1024 slots (a power of two would have been up to 2x)
    for n in range(4097, 40000, 997):
        assert 0 <= G.cache_bucket(n) - n < 1024
    # 64 rows x 8.2k tokens of a Qwen3-8B-shaped cache (36 layers, 8 KV heads, head 128, bf16): slots 9216, not 16384
    assert G.cache_bucket(8200 + 256 + 16) == 9216


def test_batch_bucket_padding_rows_are_inert(pair):
    """3 rows run as 4 (5 as 8): the padding rows never reach the result, and each real row is what it is alone."""
    target, drafter = pair
    for lens in ((5, 11, 7), (4, 9, 6, 3, 8)):
        rows = _rows(len(lens), lens)
        call = G.speculative_call(target, drafter, rows, max_new_tokens=NEW)
        B = G.batch_bucket(len(rows))
        assert call.args[2].shape[0] == B and (np.asarray(call.args[3])[len(rows):] == 0).all()
        sp = dj.generate(target, drafter, rows, max_new_tokens=NEW)
        ar = dj.generate_autoregressive(target, rows, max_new_tokens=NEW)
        assert sp.tokens.shape == (len(rows), NEW) and sp.acceptance_lengths.shape[0] == len(rows)
        assert sp.token_lists() == ar.token_lists() == _alone(
            lambda p, **kw: dj.generate_autoregressive(target, p, **kw), rows, max_new_tokens=NEW)
    # sampled: a row draws from its own key stream, whatever the padding after it
    rows = _rows(7, (6, 10, 4))
    kw = dict(max_new_tokens=NEW, temperature=1.0, seed=3)
    three = dj.generate(target, drafter, rows, **kw).token_lists()
    four = dj.generate(target, drafter, rows + [_rows(8, (5,))[0]], **kw).token_lists()
    assert three == four[:3]


# -- conventions ---------------------------------------------------------------------------------------------------

def _padded(rows, side):
    T = max(map(len, rows)) + 2  # wider than the longest row: every row has padding
    ids = np.full((len(rows), T), 7, np.int32)  # a real token id as filler, so only the mask tells it apart
    mask = np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_attention_mask_padding_equals_rows_alone(pair, side):
    target, drafter = pair
    rows = _rows(11, (6, 13, 3))
    ids, mask = _padded(rows, side)
    ar_alone = _alone(lambda p, **kw: dj.generate_autoregressive(target, p, **kw), rows, max_new_tokens=NEW)
    sp = dj.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=NEW)
    ar = dj.generate_autoregressive(target, ids, attention_mask=mask, max_new_tokens=NEW)
    assert sp.token_lists() == ar.token_lists() == ar_alone
    np.testing.assert_array_equal(sp.prompt_lengths, [len(r) for r in rows])
    # negative control: without the mask the padding is read as tokens and the rows change
    unmasked = dj.generate_autoregressive(target, ids, max_new_tokens=NEW).token_lists()
    assert unmasked != ar_alone
    if side == "right":
        lens = mask.sum(axis=1)
        assert dj.generate(target, drafter, ids, prompt_lengths=lens, max_new_tokens=NEW).token_lists() == ar_alone


def test_attention_mask_bad_input_is_refused(pair):
    target, drafter = pair
    ids = np.ones((2, 5), np.int32)
    cases = [
        (dict(attention_mask=np.ones((2, 4))), "does not match"),
        (dict(attention_mask=np.array([[1, 0, 1, 1, 1], [1] * 5])), "contiguous"),
        (dict(attention_mask=np.array([[0] * 5, [1] * 5])), "no real token"),
        (dict(attention_mask=np.full((2, 5), 2)), "only 0 and 1"),
        (dict(prompt_lengths=[3]), "prompt_lengths"),
        (dict(prompt_lengths=[0, 5]), "outside 1..5"),
        (dict(attention_mask=np.ones((2, 5)), prompt_lengths=[5, 5]), "not both"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dj.generate(target, drafter, ids, max_new_tokens=4, **kw)


class _SpyTokenizer:
    """decode joins ids; records what it was given (to prove no -1 reaches a tokenizer)."""

    def __init__(self):
        self.seen = []

    def decode(self, ids, **kwargs):
        self.seen.append(list(ids))
        return " ".join(map(str, ids))


def test_return_prompt_and_decode(pair):
    target, drafter = pair
    rows = _rows(21, (4, 9))
    eos = dj.generate_autoregressive(target, rows, max_new_tokens=NEW, eos_ids=()).tokens[0, 3]  # row 0 stops early
    plain = dj.generate(target, drafter, rows, max_new_tokens=NEW, eos_ids=(int(eos),))
    full = dj.generate(target, drafter, rows, max_new_tokens=NEW, eos_ids=(int(eos),), return_prompt=True)
    assert full.includes_prompt and not plain.includes_prompt
    assert full.tokens.shape == (2, 9 + NEW)
    assert full.token_lists() == [r + new for r, new in zip(rows, plain.token_lists())]
    assert full.new_token_lists() == plain.token_lists()
    assert plain.num_tokens[0] == 4 and (full.tokens[0, 4 + 4:] == -1).all()  # PAD only after a row's end
    tok = _SpyTokenizer()
    texts = full.decode(tok)
    assert texts == [" ".join(map(str, r + new)) for r, new in zip(rows, plain.token_lists())]
    assert all(-1 not in ids for ids in tok.seen)
    assert plain.decode(tok) == [" ".join(map(str, new)) for new in plain.token_lists()]
    np.testing.assert_array_equal(full.acceptance_lengths, plain.acceptance_lengths)


def test_return_prompt_decodes_with_the_shipped_tokenizer():
    from dflash_jax.io.shipped import checkpoints_dir
    tok = dj.Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    res = G.GenerationResult(tokens=np.array([[5, 6, 7, -1]]), num_tokens=np.array([1]),
                             acceptance_lengths=np.zeros((1, 0), np.int32), finish_reason=("eos",), num_steps=0,
                             draft_length=0, timings={}, prompt_lengths=np.array([2]), includes_prompt=True)
    assert res.decode(tok) == [tok.decode([5, 6, 7])]


def test_sampling_params_object_equals_keywords(pair):
    target, drafter = pair
    rows = _rows(31, (5, 8))
    kw = dict(max_new_tokens=NEW, seed=4)
    by_kw = dj.generate(target, drafter, rows, temperature=0.7, top_p=0.9, top_k=20, **kw)
    by_obj = dj.generate(target, drafter, rows, sampling=dj.SamplingParams(temperature=0.7, top_p=0.9, top_k=20), **kw)
    np.testing.assert_array_equal(by_obj.tokens, by_kw.tokens)
    greedy = dj.generate_autoregressive(target, rows, max_new_tokens=NEW)
    np.testing.assert_array_equal(
        dj.generate_autoregressive(target, rows, sampling=dj.SamplingParams(), max_new_tokens=NEW).tokens,
        greedy.tokens)
    ar_kw = dj.generate_autoregressive(target, rows, temperature=0.7, top_k=20, **kw)
    ar_obj = dj.generate_autoregressive(target, rows, sampling=dj.SamplingParams(temperature=0.7, top_k=20), **kw)
    np.testing.assert_array_equal(ar_obj.tokens, ar_kw.tokens)
    with pytest.raises(ValueError, match="not both"):
        dj.generate(target, drafter, rows, sampling=dj.SamplingParams(temperature=0.7), temperature=0.5, **kw)
    with pytest.raises(ValueError, match="SamplingParams"):
        dj.generate(target, drafter, rows, sampling={"temperature": 0.7}, **kw)
    with pytest.raises(ValueError, match="temperature"):
        dj.generate(target, drafter, rows, sampling=dj.SamplingParams(temperature=-1.0), **kw)


def test_eos_defaults_to_the_config(pair):
    target, drafter = pair
    rows = _rows(41, (6, 7))
    free = dj.generate_autoregressive(target, rows, max_new_tokens=NEW).token_lists()  # the config has no EOS
    assert all(len(r) == NEW for r in free)
    eos = free[0][4]
    t2, d2 = target.replace(config=CFG.replace(eos_token_id=eos)), drafter
    assert G.default_eos_ids(t2) == (eos,)
    for res in (dj.generate(t2, d2, rows, max_new_tokens=NEW), dj.generate_autoregressive(t2, rows, max_new_tokens=NEW)):
        want = free[0][:free[0].index(eos) + 1]
        assert res.token_lists()[0] == want and res.finish_reason[0] == "eos"
    # eos_ids=() explicitly: no EOS at all
    assert dj.generate(t2, d2, rows, max_new_tokens=NEW, eos_ids=()).token_lists() == free
