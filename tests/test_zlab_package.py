"""z-lab's own code as the oracle: the `dflash` package (z-lab/dflash 0.1.0 on PyPI, installed with --no-deps: its
declared dependencies `datasets` and `requests` serve its benchmark module only) runs its `dflash_generate` loop and
its `DFlashDraftModel`, in torch, against transformers' `Qwen3_5ForCausalLM`, both loaded from folders dflash-jax
wrote (`save_hf`).

z-lab's loop rolls the target back with `DynamicCache.crop`, and transformers 5.23's crop restores the KV and conv
states of a hybrid target but not the Gated DeltaNet recurrent state (`LinearAttentionCacheLayerMixin.crop`; its
`is_croppable` says so): run as released, the loop's output leaves the target's own greedy output at the first
rejected draft (shown below). So the oracle runs z-lab's loop and drafter unchanged and gives it a target whose
every call is recomputed from the committed tokens (no state to roll back, exact by construction); dflash-jax's
per-step acceptance lengths and tokens must equal that loop's.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import dflash_jax as dj
import helpers as H
import report
from test_hybrid import PROMPTS, hybrid_copy_target

zlab = pytest.importorskip("dflash.model", reason="z-lab's package: pip install --no-deps dflash==0.1.0")
torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5", reason="the hybrid oracle needs transformers 5.x")

NEW = 24
STATS = report.section("z-lab package")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The hybrid copy target and the flawed copy drafter (partial, ragged acceptance), in both frameworks."""
    target = hybrid_copy_target()
    _, drafter = H.build_copy_pair(H.FLAW)
    root = tmp_path_factory.mktemp("zlab")
    dj.save_hf(root / "target", target)
    dj.save_hf(root / "drafter", drafter)
    hf_target = qwen3_5.Qwen3_5ForCausalLM.from_pretrained(root / "target", torch_dtype=torch.float32).eval()
    zlab_drafter = zlab.DFlashDraftModel.from_pretrained(root / "drafter", torch_dtype=torch.float32).eval()
    return target, drafter, hf_target, zlab_drafter


class RecomputedTarget(torch.nn.Module):
    """The HF target as z-lab's loop calls it, with each call recomputed from scratch over the committed tokens
    (positions below the call's first position) plus the call's own: the state after any accepted prefix is exact
    because nothing is ever rolled back. z-lab's loop keeps no cache for it (see `_zlab_run`)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.committed = model, model.config, []

    @property
    def device(self):
        return self.model.device

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    @property
    def lm_head(self):
        return self.model.lm_head

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=True, logits_to_keep=0,
                output_hidden_states=False):
        first, n = int(position_ids[0, 0]), input_ids.shape[1]
        self.committed = self.committed[:first] + input_ids[0].tolist()
        out = self.model(torch.tensor([self.committed]), output_hidden_states=output_hidden_states)
        keep = logits_to_keep or n
        hidden = tuple(h[:, -n:] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=out.logits[:, -keep:], hidden_states=hidden)


def _zlab_run(target, zlab_drafter, prompt, monkeypatch):
    # z-lab times its loop with torch.cuda.synchronize(); this CPU run times with the host clock
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    if isinstance(target, RecomputedTarget):  # no target cache: nothing for the loop to crop
        make, crop = zlab._make_cache, zlab._crop_to
        monkeypatch.setattr(zlab, "_make_cache", lambda cfg: NO_CACHE if cfg is target.config else make(cfg))
        monkeypatch.setattr(zlab, "_crop_to", lambda cache, n: None if cache is NO_CACHE else crop(cache, n))
        target.committed = []
    out = zlab.dflash_generate(zlab_drafter, target, torch.tensor([prompt]), max_new_tokens=NEW,
                               stop_token_ids=None, temperature=0.0, return_stats=True)
    monkeypatch.undo()
    return list(out.acceptance_lengths), out.output_ids[0, len(prompt):].tolist()


NO_CACHE = object()


def test_acceptance_lengths_equal_zlabs_own_loop_on_a_hybrid_target(pair, monkeypatch):
    target, drafter, hf_target, zlab_drafter = pair
    res = dj.generate(target, drafter, PROMPTS, max_new_tokens=NEW)
    ar = dj.generate_autoregressive(target, PROMPTS, max_new_tokens=NEW)
    oracle = RecomputedTarget(hf_target)
    partial = 0
    for b, prompt in enumerate(PROMPTS):
        acc, tokens = _zlab_run(oracle, zlab_drafter, prompt, monkeypatch)
        got = res.acceptance_lengths[b][res.acceptance_lengths[b] > 0].tolist()
        assert tokens == res.token_lists()[b] == ar.token_lists()[b], f"row {b}: tokens differ"
        # z-lab records what a step emitted (its last step cut to the budget: produced = min(a + 1, what is left;
        # the prefill's token counts); dflash-jax records the verify's a + 1 (`GenerationResult.acceptance_lengths`)
        left = NEW - 1 - sum(got[:-1])
        assert got[:-1] == acc[:-1] and min(got[-1], left) == acc[-1], \
            f"row {b}: acceptance lengths {got} vs z-lab's {acc}"
        partial += 1 < max(acc) < drafter.config.block_size
    assert partial >= 2, "the pair must accept partially on several rows for the comparison to mean anything"
    STATS["hybrid target, acceptance lengths identical to z-lab dflash 0.1.0's loop"] = (
        f"{len(PROMPTS)} rows, tau {res.tau:.2f}, {partial} with partial acceptance")


def test_zlabs_loop_as_released_loses_the_hybrid_targets_output(pair, monkeypatch):
    """Why the oracle recomputes: with transformers' cache, z-lab's loop keeps the DeltaNet state of rejected drafts,
    and its output departs from the target's greedy output (row 0 at its third new token), while dflash-jax's
    equals it."""
    target, _, hf_target, zlab_drafter = pair
    ar = dj.generate_autoregressive(target, PROMPTS[:1], max_new_tokens=NEW).token_lists()[0]
    _, tokens = _zlab_run(hf_target, zlab_drafter, PROMPTS[0], monkeypatch)
    assert tokens != ar
