"""Train a DFlash2 drafter for a frozen target: the DFlash recipe plus a selector loss.

The block part is train/drafter.py's recipe unchanged (its data, anchors and batches are imported, not copied): the
target's own continuations of corpus prompts; random anchors a per sequence; block [x_a, M x (bs-1)] at positions
a..a+bs-1 seeing the target context strictly before a and its own whole block; slot k predicts x_{a+k} with weight
w_k = exp(-(k-1)/gamma); target, embedding and LM head frozen. The DFlash2 drafter runs its grouped dynamic
convolutions and layer rules (causal / sliding window) inside that same forward, exactly as at inference.

Objective: loss = base + selector_weight * selector, with
  base      the DFlash loss on the drafter's base logits (after output_multiplier / softcapping, as at inference);
  selector  at every slot t: the selector's k candidates are the top-k of the base logits, scored
            S_t(b) = U_t(b) + <A[prev] * P(h_t), B[b]>, where prev is the TRUE previous token (x_{a+t-1}; the anchor
            x_a for t = 1); cross-entropy of softmax(S_t) against the index of the true token x_{a+t} among the
            candidates, with the same weights w_k; slots whose true token is not among the candidates are left out
            (nothing to pick), normalised by the weight of the slots kept.
Why this objective (the official one is unpublished; NeMo's
`nemo_automodel.components.speculative.dflash.dflash2_core` has the same shape):
  * teacher forcing with the true predecessor is not an approximation for speculative decoding: slot t can only be
    accepted when every earlier slot was, i.e. when the walk's predecessor IS the true token, so the conditioning
    the loss trains is exactly the one under which the selector's choice matters;
  * the softmax over the k candidates is the selector's q at T = 1, so the loss trains the very distribution that
    rejection sampling uses, and its argmax (greedy) at the same time;
  * the same decay weights as the base loss: late slots are rarely reached, for the selector as for the logits;
  * gradients flow into everything the scores depend on: codebooks, hidden projection, the drafter body (via h_t)
    and the unary scores (the top-k values of the base logits; the top-k choice itself is not differentiable). The
    conv has no separate loss: it is trained by both terms through h_t.
Initialisation makes a fresh DFlash2 drafter exactly a DFlash drafter (identity base kernels, zero dynamic taps,
zero hidden projection: the selector picks the top logit); `--init-from` can start the shared weights from a
trained DFlash drafter.

    dflash-jax train-drafter --kind dflash2          # -> checkpoints/drafter2 (resumable: rerun the same command)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import selector as sel_mod
from dflash_jax.io.checkpoint import load_target
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import Drafter, head_logits
from dflash_jax.train.drafter import (CHECKPOINTS, add_training_arguments, eval_eos, eval_prompts_and_length,
                                      mask_token_id, measure_tau, resolve_target_and_tokenizer, shipped_drafter_config,
                                      tau_eval_fn, train_and_save, write_report)
from dflash_jax.train.drafter_data import build_data_or_exit
from dflash_jax.train.drafter_loss import decay_gamma, restrict_to_vocabulary, training_hidden, training_labels
from dflash_jax.train.drafter import warm_start  # noqa: F401  (re-exported: the notebooks import it from here)
from dflash_jax.train.loop import cross_entropy, load_training_tokenizer


def shipped_drafter2_config(target_cfg: TargetConfig, mask_token_id: int, *, layers: int = 1, block_size: int = 16,
                            taps: int = 3, tap_ids=None, conv_kernel_size: int = 2, conv_group_size: int = 16,
                            selector_rank: int = 64, selector_top_k: int = 16,
                            sliding_window: int | None = None) -> DrafterConfig:
    """The DFlash drafter's layout plus DFlash2's modules; non-causal like z-lab's DFlash2 configs. With a sliding
    window every layer is "sliding_attention" (non-causal, window both ways)."""
    base = shipped_drafter_config(target_cfg, mask_token_id, layers=layers, block_size=block_size, taps=taps,
                                  tap_ids=tap_ids)
    return base.replace(kind="dflash2", is_causal=False, conv_kernel_size=conv_kernel_size,
                        conv_group_size=conv_group_size, selector_rank=selector_rank, selector_top_k=selector_top_k,
                        layer_types=("sliding_attention",) * layers if sliding_window else None,
                        sliding_window=sliding_window)


def selector_terms(params, h: jax.Array, logits: jax.Array, batch, cfg: DrafterConfig, vocab=None):
    """Teacher-forced selector scores for every slot: h [B, N, D, H], logits [B, N, D, V] (over the token ids
    `vocab` when given: a loss vocabulary) -> (scores [B, N, D, k], target index [B, N, D], usable [B, N, D]: label
    valid and among the candidates)."""
    B, N, D, H = h.shape
    labels, valid = training_labels(batch, cfg.block_size)  # [B, N, D]
    x_a = jnp.take_along_axis(batch["tokens"], batch["anchors"], axis=1)  # [B, N]
    prev = jnp.concatenate([x_a[:, :, None], labels[:, :, :-1]], axis=2)  # true predecessor of slot t
    unary, cand = sel_mod.candidates(logits.reshape(B * N, D, -1), cfg.selector_top_k)  # [B*N, D, k]
    if vocab is not None:
        cand = jnp.take(vocab, cand)  # positions in the loss vocabulary -> token ids
    pair = sel_mod.pair_scores(params.candidate_selector, h.reshape(B * N, D, H), prev.reshape(B * N, D, 1), cand)
    scores = (unary + pair[:, :, 0]).reshape(B, N, D, -1)
    hit = cand.reshape(B, N, D, -1) == labels[..., None]  # [B, N, D, k]
    return scores, jnp.argmax(hit, axis=-1), valid & hit.any(axis=-1)


def drafter2_loss(cfg: DrafterConfig, target_cfg: TargetConfig, gamma: float | None = None,
                  selector_weight: float = 1.0, vocab_ids: np.ndarray | None = None):
    """loss_fn(params, batch) -> (base + selector_weight * selector, metrics). See the module docstring.
    vocab_ids: the base loss's softmax and the selector's candidates over these token ids only (`drafter_loss`'s
    loss vocabulary; a label outside them is left out of the base loss, and has no candidate)."""
    if not cfg.is_dflash2:
        raise ValueError("drafter2_loss needs a DFlash2 drafter config (kind='dflash2')")
    bs = cfg.block_size
    gamma = decay_gamma(bs) if gamma is None else gamma
    weights = jnp.exp(-jnp.arange(bs - 1, dtype=jnp.float32) / gamma)  # slot k=1..bs-1 -> exp(-(k-1)/gamma)
    vocab, restrict = (None, None) if vocab_ids is None else restrict_to_vocabulary(vocab_ids, target_cfg.vocab_size)

    def loss_fn(params, batch):
        h, target = training_hidden(params, batch, cfg, target_cfg)  # [B, N, D, H]
        labels, valid = training_labels(batch, bs)
        if restrict is not None:  # labels: their positions in the loss vocabulary
            target, labels, valid = restrict(target, labels, valid)
        logits = head_logits(Drafter(params=params, config=cfg), target, h, full_vocabulary=True)  # [B, N, D, V]
        w = weights[None, None, :] * valid
        base = jnp.sum(w * cross_entropy(logits, labels)) / (jnp.sum(w) + 1e-6)
        scores, idx, usable = selector_terms(params, h, logits, batch, cfg, vocab)
        ws = weights[None, None, :] * usable
        sel = jnp.sum(ws * cross_entropy(scores, idx)) / (jnp.sum(ws) + 1e-6)
        n_valid = jnp.maximum(jnp.sum(valid), 1)
        base_ok = (jnp.argmax(logits, axis=-1) == labels) & valid
        sel_ok = (jnp.argmax(scores, axis=-1) == idx) & usable  # a slot whose label is not a candidate is wrong
        metrics = {"base_loss": base, "selector_loss": sel, "acc": jnp.sum(base_ok) / n_valid,
                   "selector_acc": jnp.sum(sel_ok) / n_valid, "topk_coverage": jnp.sum(usable) / n_valid,
                   "selector_acc_slot1": jnp.sum(sel_ok[:, :, 0]) / jnp.maximum(jnp.sum(valid[:, :, 0]), 1)}
        return base + selector_weight * sel, metrics

    return loss_fn


def main(argv=None):
    ap = argparse.ArgumentParser(prog="dflash-jax train-drafter --kind dflash2",
                                 description="Train a DFlash2 drafter for the shipped target (resumable); data flags "
                                             "and defaults are train-drafter's")
    add_training_arguments(ap, out=CHECKPOINTS / "drafter2", work_dir=".train/drafter2",
                           work_help="orbax checkpoints (resume) and logs")
    ap.add_argument("--data-dir", default=None,
                    help="data cache (default: --work-dir); train-drafter's work dir reuses its continuations and "
                         "target features when the data flags and taps match")
    ap.add_argument("--init-from", default=None, help="start the shared weights from this DFlash drafter folder")
    ap.add_argument("--conv-kernel-size", type=int, default=2, help="DFlash2 conv taps (z-lab: 2)")
    ap.add_argument("--conv-group-size", type=int, default=16, help="channels per dynamic tap (z-lab: 16)")
    ap.add_argument("--selector-rank", type=int, default=64, help="selector codebook rank (z-lab: 256)")
    ap.add_argument("--selector-top-k", type=int, default=16, help="selector candidates per slot (z-lab: 16)")
    ap.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector loss")
    ap.add_argument("--sliding-window", type=int, default=None, help="make every layer sliding-window (non-causal)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    resolve_target_and_tokenizer(args)
    tok = load_training_tokenizer(args.tokenizer)
    target = load_target(args.target, compute_dtype="float32")
    cfg = shipped_drafter2_config(target.config, mask_token_id(tok, args), layers=args.layers, block_size=args.block_size,
                                  taps=args.taps, tap_ids=args.tap_ids, conv_kernel_size=args.conv_kernel_size,
                                  conv_group_size=args.conv_group_size, selector_rank=args.selector_rank,
                                  selector_top_k=args.selector_top_k, sliding_window=args.sliding_window)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else work
    data_dir.mkdir(parents=True, exist_ok=True)
    data = build_data_or_exit(target, tok, cfg, data_dir, args)
    eval_prompts, d7 = eval_prompts_and_length(tok, cfg, args)
    drafter, history = train_and_save(cfg, target, data, args, work,
                                      drafter2_loss(cfg, target.config, selector_weight=args.selector_weight),
                                      tau_eval_fn(target, cfg, eval_prompts, args.eval_tokens, d7, eval_eos(tok, args)),
                                      desc="drafter2", exact_warm_start=False)
    final = history[-1] if history else {}
    tau = measure_tau(target, drafter, eval_prompts, max_new_tokens=args.eval_tokens, draft_length=d7, eos_ids=eval_eos(tok, args))
    report = {"command": "dflash-jax train-drafter --kind dflash2 " + " ".join(argv or []), "steps": args.steps,
              "layers": args.layers, "batch": args.batch, "anchors_per_sequence": args.anchors,
              "prompts": args.prompts, "new_tokens": args.new_tokens,
              "generated_tokens": int((data["lengths"] - data["prompt_lens"]).sum()),
              "gamma": decay_gamma(args.block_size), "selector_weight": args.selector_weight,
              "init_from": args.init_from, "train_loss": final.get("loss"), "base_loss": final.get("base_loss"),
              "selector_loss": final.get("selector_loss"), "train_acc": final.get("acc"),
              "selector_acc": final.get("selector_acc"), "topk_coverage": final.get("topk_coverage"),
              f"tau_eval_{len(eval_prompts)}_prompts_{args.eval_tokens}_tokens_D{d7}": tau["tau"],
              "position_acceptance": tau["position_acceptance"]}
    write_report(args.out, report, t_start, drafter)
    return report


if __name__ == "__main__":
    main()
