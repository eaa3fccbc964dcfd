"""Helpers several test modules share (the DFlash and DFlash2 generation, EOS, reference and training tests): tiny
random configs, the hand-built "copy" pair, the cache-free greedy reference loop, jaxpr walkers, and the forwards
that `audit_scales` differentiates. Kept here once instead of copied from one test module into another.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from random_models import nontrivial_dflash2, random_params
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io.safetensors_io import write_safetensors
from dflash_jax.models.drafter import draft_proposal
from dflash_jax.params import abstract_drafter, abstract_target, from_named, named_leaves
from dflash_jax.quant.linear import set_default_backend

# The package re-exports the *function* as `dflash_jax.quant.linear`, shadowing the submodule.
linear_mod = importlib.import_module("dflash_jax.quant.linear")
programs_mod = importlib.import_module("dflash_jax.decode.programs")  # the package re-exports `generate` by that name


@pytest.fixture
def no_work():
    """Asserts that the call under test neither traced nor compiled anything (a refusal before any work). Test modules
    take it with `from helpers import no_work`."""
    traces, held = dict(programs_mod.TRACE_COUNTS), programs_mod.compiled_counts()
    yield
    # A trace is what a compile starts with; the jit caches may drop an entry meanwhile (a collected weak key), never
    # gain one without a trace.
    assert dict(programs_mod.TRACE_COUNTS) == traces, "work was done before the error"
    assert all(n <= held[k] for k, n in programs_mod.compiled_counts().items()), ("work was done before the error",
                                                                                   held)


def tiny_qwen3(**kw) -> TargetConfig:
    """A tiny float32 Qwen3 config (vocab 64, hidden 32, 4 layers, GQA 4:2, head_dim 8, untied); kw overrides."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)
    base.update(kw)
    return TargetConfig(**base)


# -- the random setups of the generation tests ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    target: TargetConfig
    drafter: DrafterConfig
    draft_length: int | None  # None = block_size - 1


def _setups():
    """Three tiny pairs: tied GQA 2:1 (bs 8); untied MHA, the drafter with its own heads (bs 4, D 1); GQA 4:1."""
    c1 = tiny_qwen3(tie_word_embeddings=True)  # tied, GQA 2:1, 4 layers (also the trained-drafter target)
    c2 = tiny_qwen3(vocab_size=96, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16)  # untied, MHA
    c3 = tiny_qwen3(vocab_size=128, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=12)  # untied, GQA 4:1
    return [
        Setup("tied-gqa2-bs8-D7", c1, DrafterConfig(c1.replace(num_hidden_layers=1), 8, 63, (1, 2), 4), None),
        Setup("untied-mha-bs4-D1", c2, DrafterConfig(  # the drafter's own heads differ from the target's
            c2.replace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8), 4, 95, (0,), 2),
              1),
        Setup("untied-gqa4-bs6-D3", c3, DrafterConfig(c3.replace(num_hidden_layers=1), 6, 127, (0, 2), 3), 3),
    ]


SETUPS = _setups()


def prompt_batches(vocab: int, seed: int, n_batches: int = 3):
    """Batches of 3 prompts with mixed lengths in 1..16 (one padded bucket); includes lengths 1 and 16."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_batches):
        lens = [1, 16, 7] if i == 0 else rng.integers(2, 17, 3).tolist()
        out.append([rng.integers(0, vocab, n).tolist() for n in lens])
    return out


def first_mismatch(target, prompt, a_row, b_row):
    """Diagnostic for a failure: position of the first differing token and the target's top-1/top-2 margin there."""
    i = int(np.argmax(a_row != b_row))
    seq = list(prompt) + [int(t) for t in a_row[:i]]
    logits, _ = dj.target_forward(target, np.asarray([seq], np.int32))
    top = np.sort(np.asarray(logits[0, -1]))[::-1]
    return (f"first difference at new token {i}: AR {a_row[i]} vs spec {b_row[i]}, "
            f"target top1-top2 logit margin there {top[0] - top[1]:.3e}")


def assert_same(target, prompts, ar, sp, what=""):
    for b, p in enumerate(prompts):
        if not np.array_equal(ar.tokens[b], sp.tokens[b]):
            raise AssertionError(f"{what} row {b}: speculative != autoregressive; "
                                 + first_mismatch(target, p, ar.tokens[b], sp.tokens[b]))
    np.testing.assert_array_equal(ar.num_tokens, sp.num_tokens)
    assert ar.finish_reason == sp.finish_reason


# -- the hand-built "copy" pair (a perfect drafter by construction) -----------------------------------------------
#
# Target: vocab 48 = 6 cycles of 8 tokens; greedy next token = pi(x) = the next token of x's cycle. Its layers are
# random but scaled down (o_proj / down_proj x 0.01), so greedy is pi while the logits still depend on the KV cache.
# Embeddings e_x = u + w_x (u shared, w_x orthonormal) and lm_head[y] = e_{pi^-1(y)}.
# Drafter (1 layer): q and k are content-free constants (q_proj/k_proj read only u; q_norm/k_norm set them), so the
# attention score is a function of the relative position only (RoPE), peaked at distance P + 1 = 9: block slot k
# (position start + k) reads the context token at start + k - 9, copies its embedding (v_proj = I, o_proj = 100 I)
# and the target's lm_head turns it into pi(x_{start+k-9}) = x_{start+k-8} = x_{start+k}: exact once the sequence
# has one full period of history. With `flaw`, v_proj swaps the directions of token pairs, so every draft that copies
# a flawed token is wrong: acceptance then stops at a step-dependent slot (partial acceptance).

PV, PH, PERIOD, PBS = 48, 64, 8, 8
PMASK = PV - 1  # the mask id is also a real token of cycle 5
PCFG = tiny_qwen3(vocab_size=PV, hidden_size=PH, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
PDCFG = DrafterConfig(PCFG.replace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16),
                      PBS, PMASK, (1, 0), 2)


def cycle_next(x):
    return (x // PERIOD) * PERIOD + (x + 1) % PERIOD


def build_copy_pair(flaw: tuple[tuple[int, int], ...] = (), family: str = "qwen3", scale: float = 0.01):
    """(copy target, copy drafter); family: the target's decoder family ("qwen3", or "llama": no q/k norm), the same
    construction either way (the drafter reads only its embeddings and its layer-1 output). scale: what the target's
    layers add to the residual stream (o_proj / down_proj factor): at 0.01 greedy is the cycle map whatever the
    context; at 0.3 the target follows the cycle only now and then, and its tokens depend on the whole context."""
    cfg = PCFG if family == "qwen3" else PCFG.replace(model_type=family, qk_norm=None, attention_bias=None)
    rng = np.random.default_rng(1234)
    Q, _ = np.linalg.qr(rng.standard_normal((PH, PH)))
    u, W = Q[:, 0], Q[:, 1:PV + 1].T  # W [V, H]: orthonormal rows, orthogonal to u
    emb = u[None, :] + W
    inv = np.empty(PV, int)
    inv[cycle_next(np.arange(PV))] = np.arange(PV)
    tp = random_params(abstract_target(cfg), 5)
    layers = tuple(dataclasses.replace(
        l, self_attn=dataclasses.replace(l.self_attn, o_proj=scale * l.self_attn.o_proj),
        mlp=dataclasses.replace(l.mlp, down_proj=scale * l.mlp.down_proj)) for l in tp.layers)
    tp = dataclasses.replace(tp, embed_tokens=jnp.asarray(emb, jnp.float32), lm_head=jnp.asarray(emb[inv], jnp.float32),
                             norm=jnp.ones((PH,), jnp.float32), layers=layers)
    target = dj.Target(params=tp, config=cfg)

    m = PDCFG.model
    hd, nH = m.head_dim, m.num_attention_heads
    theta = m.rope_theta ** (-np.arange(hd // 2) * 2.0 / hd)
    offset, scale = PERIOD + 1, 25.0
    q_norm = scale * np.concatenate([np.ones(hd // 2), np.zeros(hd // 2)])
    k_norm = scale * np.concatenate([np.cos(offset * theta), np.sin(offset * theta)])
    v = np.eye(PH)
    for x, y in flaw:  # swap the value directions of tokens x and y
        a, b = W[x], W[y]
        v = v - np.outer(a, a) - np.outer(b, b) + np.outer(b, a) + np.outer(a, b)
    dp = random_params(abstract_drafter(PDCFG), 6, std=0.02)
    l0 = dp.layers[0]
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    attn = dataclasses.replace(l0.self_attn, q_proj=f32(np.outer(np.ones(nH * hd), u)),
                               k_proj=f32(np.outer(np.ones(m.num_key_value_heads * hd), u)), v_proj=f32(v),
                               o_proj=f32(100.0 * np.eye(PH)), q_norm=f32(q_norm), k_norm=f32(k_norm))
    l0 = dataclasses.replace(l0, self_attn=attn, mlp=dataclasses.replace(l0.mlp, down_proj=0 * l0.mlp.down_proj))
    fc = np.zeros((PH, 2 * PH))
    fc[:, :PH] = np.eye(PH)  # first tap (layer 1 output ~ the token's embedding)
    dp = dataclasses.replace(dp, fc=f32(fc), layers=(l0,))
    return target, dj.Drafter(params=dp, config=PDCFG)


def as_dflash2(drafter: dj.Drafter, seed: int, *, group: int = 16, rank: int = 8, top_k: int = 8,
               **scales) -> dj.Drafter:
    """The same drafter as DFlash2 (conv group size `group`, selector rank `rank`, top-`top_k` candidates) with the
    fresh conv and selector made non-trivial (`random_models.nontrivial_dflash2`, `scales` passed on); the DFlash
    weights it shares are kept as they are."""
    cfg = dataclasses.replace(drafter.config, kind="dflash2", conv_group_size=group, selector_rank=rank,
                              selector_top_k=top_k)
    named = dict(named_leaves(drafter.params))
    fresh = named_leaves(dj.init_drafter(cfg, jax.random.key(seed)).params)
    named.update({n: v for n, v in fresh.items() if n not in named})
    params = nontrivial_dflash2(from_named(abstract_drafter(cfg), named), seed, **scales)
    return dj.Drafter(params=params, config=cfg)


def cycle_prompt(first: int, n: int):
    out, x = [], first
    for _ in range(n):
        out.append(x)
        x = cycle_next(x)
    return out


# row 0: cycle 0 (0..7), row 1: cycle 5 (40..47, contains the mask id 47), row 2: cycle 2 (16..23)
COPY_PROMPTS = [cycle_prompt(0, 11), cycle_prompt(40, 13), cycle_prompt(18, 10)]
COPY_MAX_NEW = 24
# Drafts copying token 1 or 5 (cycle 0 = row 0) come out as pi(33) / pi(29): any 7 consecutive tokens of the cycle
# contain 1 or 5, so every step of row 0 stops at a step-dependent slot; rows 1 and 2 keep whole blocks.
FLAW = ((5, 29), (1, 33))


def pad_to(seq, n):
    return np.asarray([list(seq) + [0] * (n - len(seq))], np.int32)


def argmax_drafts(target, drafter, features, block):
    """DFlash greedy proposals straight from `draft_logits` (not through `draft_tokens`, which is under test)."""
    return np.asarray(dj.draft_logits(target, drafter, features, block)).argmax(-1)


def reference_acceptance(target, drafter, prompt, *, max_new, max_steps, propose=argmax_drafts, draft_length=None,
                         draft_pass="block"):
    """Cache-free DFlash greedy loop: each step drafts with `draft_logits` on the full committed context (features of
    positions 0..start-1 from a fresh `target_forward` over the committed sequence) and verifies with
    `target_forward` over the committed sequence + drafts; accept the longest matching prefix + the bonus.
    `propose(target, drafter, features, block)` gives the drafts [1, >= D] (DFlash2 tests pass the selector walk).
    draft_length D (default block_size - 1); draft_pass "block": the block holds the last token and block_size - 1
    mask tokens, "drafted": the last token and D mask tokens (`models.drafter.draft_block`).
    Returns (acceptance lengths per step, emitted tokens). Sequences are right-padded to one length so target_forward
    compiles once (causal: padding after a position cannot change it)."""
    cfg = drafter.config
    bs, M, taps = cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids
    D = bs - 1 if draft_length is None else draft_length
    block_width = D + 1 if draft_pass == "drafted" else bs
    width = len(prompt) + max_new + bs
    logits, _ = dj.target_forward(target, pad_to(prompt, width), layer_ids=taps)  # one compile for all calls
    out = [int(np.argmax(np.asarray(logits)[0, len(prompt) - 1]))]  # prefill token
    acc = []
    while len(out) < max_new and len(acc) < max_steps:
        seq = list(prompt) + out
        start = len(seq) - 1  # position of the last committed token
        _, feats = dj.target_forward(target, pad_to(seq, width), layer_ids=taps)
        block = np.full((1, block_width), M, np.int32)
        block[0, 0] = seq[-1]
        drafts = np.asarray(propose(target, drafter, np.asarray(feats)[:, :start], block))[0, :D].tolist()
        v_logits, _ = dj.target_forward(target, pad_to(seq + drafts, width), layer_ids=taps)
        post = np.asarray(v_logits)[0, start:start + D + 1].argmax(-1).tolist()  # target token for start+j+1
        a = 0
        while a < D and drafts[a] == post[a]:
            a += 1
        acc.append(a + 1)
        out.extend((drafts[:a] + [post[a]])[:max_new - len(out)])
    return acc, out


HOST_PRIMITIVES = ("callback", "device_put", "infeed", "outfeed", "send", "recv", "print")


def primitives(jaxpr, acc=None):
    """All primitive names in a jaxpr, recursing into sub-jaxprs (pjit, cond branches, nested loops, ...)."""
    acc = [] if acc is None else acc
    for eqn in jaxpr.eqns:
        acc.append(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else (p,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    primitives(sub.jaxpr, acc)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    primitives(sub, acc)
    return acc


def host_ops(names):
    return sorted({n for n in names if any(h in n for h in HOST_PRIMITIVES)})


# -- the NVFP4 tests' inputs and the forwards they quantize, calibrate and audit ------------------------------------

def context_and_block(target, dcfg, *, batch: int = 4, length: int = 40, seed: int = 0):
    """Target features [batch, length, K*H] of random tokens and a first block [batch, bs] (last token + masks)."""
    toks = np.random.RandomState(seed).randint(0, dcfg.mask_token_id, (batch, length))
    _, feats = dj.target_forward(target, toks, dcfg.target_layer_ids)
    block = np.full((batch, dcfg.block_size), dcfg.mask_token_id)
    block[:, 0] = toks[:, -1]
    return feats, jnp.asarray(block)


def logits_of_drafter(target):
    """(drafter, features, block) -> draft logits, e.g. for `collect_linear_inputs`."""
    def fwd(drafter, feats, block):
        return dj.draft_logits(target, drafter, feats, block)
    return fwd


def logits_of_params(target, model):
    """(params, features, block) -> draft logits of `model` with those params, for `audit_scales`."""
    def fwd(params, feats, block):
        return dj.draft_logits(target, model.replace(params=params), feats, block)
    return fwd


def proposal_of_params(target, model):
    """(params, features, block) -> `draft_proposal` (logits and DFlash2 selector scores), for `audit_scales`."""
    def fwd(params, feats, block):  # logits and selector scores (the integer tokens carry no gradient)
        return draft_proposal(target, model.replace(params=params), feats, block)
    return fwd


@pytest.fixture(autouse=True)
def clean_backend(monkeypatch):
    """The NVFP4 backend back to its default around a test (no env override, no process default); a module that
    imports this fixture gets it for every test."""
    monkeypatch.delenv(linear_mod.ENV_VAR, raising=False)
    set_default_backend(None)
    yield
    set_default_backend(None)


# -- checkpoint folders ----------------------------------------------------------------------------------------------

def write_hf_folder(folder, config: dict, tensors: dict):
    """An HF model folder: config.json and one model.safetensors (torch's metadata) -> (folder, tensors)."""
    (Path(folder) / "config.json").write_text(json.dumps(config))
    write_safetensors(Path(folder) / "model.safetensors", tensors, {"format": "pt"})
    return folder, tensors


def edit_config(folder, fn, name="config.json"):
    """Apply fn to the folder's parsed config file in place."""
    p = Path(folder) / name
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def _bits(x) -> tuple:
    a = np.asarray(jax.device_get(x))
    return a.dtype, a.shape, a.tobytes()


def assert_bit_exact(a, b):
    """Same pytree structure (incl. static configs and NVFP4 shapes) and the same bytes in every leaf."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert _bits(x) == _bits(y), jax.tree_util.keystr(path)


# -- training: a batch of anchors and the inference call at each ---------------------------------------------------

def training_batch(target, tokens, lengths, anchors) -> dict:
    """The drafter trainers' batch: token rows [B, S], their lengths, anchors [B, N] (all kept), the target params."""
    return {"tokens": jnp.asarray(tokens), "lengths": jnp.asarray(lengths, jnp.int32),
            "anchors": jnp.asarray(anchors, jnp.int32), "keep": jnp.ones(np.shape(anchors), bool),
            "target": target.params}


def inference_at_anchors(target, drafter, tokens, anchors, call):
    """For every anchor a of every row b: (b, n, call(target, drafter, features [1, a, K*H], block [1, bs])), the
    block being [x_a, mask, ...]: what inference drafts from anchor a with the context strictly before it."""
    cfg = drafter.config
    _, feats = dj.target_forward(target, tokens, cfg.target_layer_ids)
    for b in range(len(anchors)):
        for n, a in enumerate(anchors[b]):
            block = np.full((1, cfg.block_size), cfg.mask_token_id)
            block[0, 0] = tokens[b, a]
            yield b, n, call(target, drafter, feats[b:b + 1, :a], block)


def assert_rounded_products_keep_greedy_exact(tmp_path, scope, option: str):
    """A GGUF target of Q4_1 / Q8_0 blocks under a rounding of its products (`scope(True)`, the generate keyword
    `option`: Q8 activations or bfloat16 products): the forward is another function, close to the float one, and
    greedy speculative decoding with it (a chain and a draft tree) equals autoregressive decoding with it token for
    token; `option=True` reaches the programs (its tokens are those of a call under the scope). -> (target, prompts)."""
    import gguf

    from gguf_files import write_target_gguf

    Q = gguf.GGMLQuantizationType
    cfg = tiny_qwen3(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=96, tie_word_embeddings=True, max_position_embeddings=256,
                     num_hidden_layers=2)
    types = {"attn_q.weight": int(Q.Q4_1), "attn_k.weight": int(Q.Q8_0), "attn_v.weight": int(Q.Q4_1),
             "attn_output.weight": int(Q.Q4_1), "ffn_gate.weight": int(Q.Q4_1), "ffn_up.weight": int(Q.Q4_1),
             "ffn_down.weight": int(Q.Q8_0), "token_embd.weight": int(Q.Q8_0)}
    target = dj.load_target(write_target_gguf(tmp_path / "t.gguf", dj.init_target(cfg, jax.random.key(9)),
                                              types=types))
    tokens = np.arange(40, dtype=np.int32).reshape(2, 20) % 96
    with scope(True):
        a = dj.target_forward(target, tokens)[0]
    b = dj.target_forward(target, tokens)[0]
    err = float(jnp.max(jnp.abs(a - b))) / float(jnp.max(jnp.abs(b)))
    assert 1e-6 < err < 5e-2, err
    drafter = dj.init_drafter(dj.DrafterConfig(model=cfg.drafter_stack(1), block_size=4, mask_token_id=0,
                                               target_layer_ids=(0, 1), num_target_layers=2), jax.random.key(10))
    prompts = [list(range(3, 20)), list(range(40, 45))]
    kw = dict(max_new_tokens=24, eos_ids=(), **{option: True})
    ar = dj.generate_autoregressive(target, prompts, **kw)
    assert ar.token_lists() == dj.generate(target, drafter, prompts, draft_length=3, **kw).token_lists()
    assert ar.token_lists() == dj.generate(target, drafter, prompts, tree_budget=4, **kw).token_lists()
    with scope(True):
        assert dj.generate_autoregressive(target, prompts, max_new_tokens=24, eos_ids=()).token_lists() == \
            ar.token_lists()
    return target, prompts
