"""The DFlash drafter's training loss, by the DFlash recipe (arXiv 2602.06036 section 3; SpecForge
`specforge/core/dflash.py` after its fix PR #473): per sequence, random anchors a in the continuation; each
anchor's block is [x_a, M x (bs-1)] at positions a..a+bs-1; it sees the target context strictly before a and its
whole block, no other block; slot k predicts x_{a+k} (same position) with weight exp(-(k-1)/gamma); slot 0 has no
loss. All blocks of a batch go through one forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import Drafter, block_pass, context_kv, embed_block, head_logits
from dflash_jax.models.layers import decoder_layer, norm
from dflash_jax.models.target import Target, forward_with_cache, lm_logits
from dflash_jax.quant.nvfp4 import NVFP4Array
from dflash_jax.train.loop import cross_entropy

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(block_size: int) -> float:
    return GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))



def training_hidden(params, batch, cfg: DrafterConfig, target_cfg: TargetConfig) -> tuple[jax.Array, Target]:
    """Final hidden states [B, N, bs-1, H] of block slots 1..bs-1 for every anchor, all blocks in one forward, and
    the frozen target (whose lm_head turns them into logits).

    For anchor a this equals inference's pass over [x_a, M, ...] with the target context strictly before a
    (tests check it): context strictly before the anchor, the whole own block, no other block. Layer rules
    (causal / sliding window) and DFlash2's block convolution apply exactly as at inference.
    """
    bs = cfg.block_size
    target = Target(params=batch["target"], config=target_cfg)
    drafter = Drafter(params=params, config=cfg)
    tokens, anchors, keep = batch["tokens"], batch["anchors"], batch["keep"]
    B, S = tokens.shape
    N = anchors.shape[1]
    if "features" in batch:  # precomputed once by `target_features` (the target is frozen)
        feats = batch["features"].astype(cfg.model.dtype)
    else:
        _, feats, _ = forward_with_cache(target, tokens, None, cfg.target_layer_ids)
    feats = jax.lax.stop_gradient(feats)  # [B, S, K*H]: the target is frozen
    ctx_kv = context_kv(drafter, feats, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))

    k = jnp.arange(bs, dtype=jnp.int32)
    positions = (anchors[:, :, None] + k).reshape(B, N * bs)  # [B, N*bs]
    x_a = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, N]
    block = jnp.where(k[None, None, :] == 0, x_a[:, :, None], cfg.mask_token_id).reshape(B, N * bs)
    block_id = jnp.repeat(jnp.arange(N), bs)  # [N*bs]
    keep_q = jnp.repeat(keep, bs, axis=1)  # [B, N*bs]
    # Context strictly before the anchor (the anchor's own feature is not visible, as at inference);
    # the whole own block; no other block; dropped anchors see nothing.
    ctx_len = jnp.where(keep_q, jnp.repeat(anchors, bs, axis=1), 0)  # [B, Q]: context slots < anchor
    sees_blk = (block_id[:, None] == block_id[None, :])[None] & keep_q[:, :, None]  # [B, Q, Q]

    h = block_pass(drafter, embed_block(drafter, target, block), positions, ctx_kv, ctx_len, mask=sees_blk)
    return h.reshape(B, N, bs, -1)[:, :, 1:], target  # slots 1..bs-1


def training_logits(params, batch, cfg: DrafterConfig, target_cfg: TargetConfig) -> jax.Array:
    """Logits [B, N, bs-1, V] of block slots 1..bs-1 for every anchor (see `training_hidden`); output_multiplier
    and final_logit_softcapping applied as at inference."""
    h, target = training_hidden(params, batch, cfg, target_cfg)
    return head_logits(Drafter(params=params, config=cfg), target, h, full_vocabulary=True)  # [B, N, bs-1, V]


def training_labels(batch, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Same-position labels: slot k of anchor a predicts x_{a+k}. Returns (labels, valid) [B, N, bs-1].

    A batch of existing text carries the target's own greedy predictions (batch["labels"] [B, S]: the argmax at
    each position given the text before it) and where they equal the text (batch["agree"]): slot k's label is then
    the prediction at a+k, kept only when the text agrees with the predictions at a+1..a+k-1, so that every kept
    label is the token greedy decoding from x_a would produce there."""
    tokens, lengths, anchors, keep = batch["tokens"], batch["lengths"], batch["anchors"], batch["keep"]
    B, S = tokens.shape
    label_pos = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)[None, None, :]
    valid = keep[:, :, None] & (label_pos < lengths[:, None, None])
    flat = jnp.minimum(label_pos, S - 1).reshape(B, -1)
    labels = jnp.take_along_axis(batch.get("labels", tokens), flat, axis=1).reshape(label_pos.shape)
    if "agree" in batch:
        agree = jnp.take_along_axis(batch["agree"], flat, axis=1).reshape(label_pos.shape)
        earlier = jnp.cumprod(agree.astype(jnp.int32), axis=-1)  # the text equals the predictions up to slot k
        valid = valid & (jnp.pad(earlier, [(0, 0), (0, 0), (1, 0)], constant_values=1)[..., :-1] > 0)
    return labels, valid


def teacher_hidden(target: Target, last_tap: jax.Array, from_layer: int) -> jax.Array:
    """The target's final-normed hidden states [B, S, H] from its residual stream after layer `from_layer`
    (last_tap, the drafter's last tapped feature): the remaining layers, causal, then the final norm.

    WHY recomputed and not stored: the shards hold that feature already (the last tap is layer 27 of SmolLM2's 30),
    so the KL teacher costs 2 layers and the head rows of the loss vocabulary at the anchored positions, a fraction
    of a step; top-k logits in the shards would mean a new data pass over every answer."""
    cfg = target.config
    B, S, _ = last_tap.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    x = last_tap.astype(cfg.dtype)
    for layer in target.params.layers[from_layer + 1:]:
        x, _, _ = decoder_layer(layer, x, positions, cfg, causal=True)
    return norm(x, target.params.norm, cfg)


def loss_vocabulary(data: dict[str, np.ndarray], first_ids: int = 0) -> np.ndarray:
    """The sorted token ids that occur in the training sequences (prompts and answers, up to each length), plus the
    ids below `first_ids`: with `--loss-vocab data` the drafter's softmax is taken over these alone (see
    `drafter_loss`). A BPE vocabulary numbers its tokens in merge order, so the low ids are the common pieces: as
    negatives they keep the drafter from scoring frequent tokens the data happens to lack."""
    tokens, lengths = data["tokens"], data["lengths"]
    live = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return np.union1d(tokens[live], np.arange(first_ids)).astype(np.int32)


def restricted_head(target: Target, vocab_ids: jax.Array) -> Target:
    """The target with its LM head cut to the rows `vocab_ids` (logit j of the result is logit vocab_ids[j] of the
    full head). Only for the training loss: inference always drafts over the whole vocabulary."""
    head = target.lm_head
    if isinstance(head, NVFP4Array):
        raise ValueError("--loss-vocab data needs a dense LM head; this target's is NVFP4")
    return target.replace(params=dataclasses.replace(target.params, lm_head=jnp.take(head, vocab_ids, axis=0)))


def restrict_to_vocabulary(vocab_ids: np.ndarray, vocab_size: int):
    """(vocab [Vs] int32, restrict): restrict(target, labels, valid) -> the target with its LM head cut to the ids
    `vocab_ids` (`restricted_head`), each label as its position among them, and valid without the labels outside
    them (the loss vocabulary of `drafter_loss` and `train.drafter2.drafter2_loss`)."""
    vocab = jnp.asarray(vocab_ids, jnp.int32)  # [Vs]
    to_sub = jnp.full((vocab_size,), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0]))

    def restrict(target: Target, labels: jax.Array, valid: jax.Array):
        sub = to_sub[labels]
        return restricted_head(target, vocab), jnp.maximum(sub, 0), valid & (sub >= 0)

    return vocab, restrict


def drafter_loss(cfg: DrafterConfig, target_cfg: TargetConfig, gamma: float | None = None,
                 vocab_ids: np.ndarray | None = None, kl_weight: float = 0.0):
    """loss_fn(drafter_params, batch): decay-weighted CE over many blocks per sequence in one forward.

    vocab_ids: take the softmax over these tokens only (`loss_vocabulary`: every token the training data contains,
    so every label is among them). The target's LM head (V x H, frozen) is most of a step's FLOPs for a small
    drafter (SmolLM2: 49,152 x 576 against a 4.5M-parameter drafter), and an instruct model's answers use a small
    part of its vocabulary, so this cuts the step several times. The drafter still drafts over the full head: a
    token outside the set only costs acceptance, never correctness, and held-out tau (measured by real decoding
    over the full vocabulary) shows what the restriction costs. A label outside vocab_ids (a draft vocabulary as
    the loss vocabulary) is left out.

    kl_weight: loss = (1 - w) CE + w KL(target || drafter), the target's next-token distribution at each label
    position (over the loss vocabulary) recomputed from the last tapped feature (`teacher_hidden`)."""
    bs = cfg.block_size
    gamma = decay_gamma(bs) if gamma is None else gamma
    weights = jnp.exp(-jnp.arange(bs - 1, dtype=jnp.float32) / gamma)  # slot k=1..bs-1 -> exp(-(k-1)/gamma)
    restrict = None if vocab_ids is None else restrict_to_vocabulary(vocab_ids, target_cfg.vocab_size)[1]

    def loss_fn(params, batch):
        labels, valid = training_labels(batch, bs)
        h, target = training_hidden(params, batch, cfg, target_cfg)
        if restrict is not None:
            target, labels, valid = restrict(target, labels, valid)
        # as `training_logits`
        logits = head_logits(Drafter(params=params, config=cfg), target, h, full_vocabulary=True)
        ce = cross_entropy(logits, labels)
        if kl_weight:
            ce = (1 - kl_weight) * ce + kl_weight * _kl_to_target(target, batch, logits, cfg.target_layer_ids)
        w = weights[None, None, :] * valid
        loss = jnp.sum(w * ce) / (jnp.sum(w) + 1e-6)
        correct = (jnp.argmax(logits, axis=-1) == labels) & valid
        acc = jnp.sum(correct) / jnp.maximum(jnp.sum(valid), 1)
        acc1 = jnp.sum(correct[:, :, 0]) / jnp.maximum(jnp.sum(valid[:, :, 0]), 1)
        return loss, {"acc": acc, "acc_slot1": acc1}

    return loss_fn


def _kl_to_target(target: Target, batch, logits: jax.Array, layer_ids) -> jax.Array:
    """KL(p_target || q_drafter) [B, N, bs-1] at each label position a+k; the teacher is the target's distribution
    there, read from the hidden state at a+k-1 (head over the same rows as the drafter's logits)."""
    H, top = target.config.hidden_size, max(layer_ids)
    i = list(layer_ids).index(top)
    tap = batch["features"][..., i * H:(i + 1) * H]  # [B, S, H]: the deepest tap
    h = jax.lax.stop_gradient(teacher_hidden(target, tap, top))
    B, N, K, _ = logits.shape
    pos = batch["anchors"][:, :, None] + jnp.arange(K, dtype=jnp.int32)[None, None, :]  # a+k-1 for k=1..bs-1
    hk = jnp.take_along_axis(h, jnp.minimum(pos, h.shape[1] - 1).reshape(B, -1)[..., None], axis=1)
    t_logp = jax.nn.log_softmax(lm_logits(target, hk).reshape(B, N, K, -1), axis=-1)  # [B, N, K, V or Vs]
    # (a restricted head's logits come padded to V with -inf: the same rows, then nothing)
    q_logp = jax.nn.log_softmax(logits[..., :t_logp.shape[-1]].astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t_logp) * (t_logp - q_logp), axis=-1)


__all__ = ["decay_gamma", "teacher_hidden", "training_hidden", "training_logits", "training_labels", "loss_vocabulary",
           "restricted_head", "restrict_to_vocabulary", "drafter_loss", "GAMMA"]
