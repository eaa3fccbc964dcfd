"""Train a DFlash drafter for a frozen target, by the DFlash recipe (arXiv 2602.06036 section 3; SpecForge
`specforge/core/dflash.py` after its fix PR #473, since z-lab has released no training code).

Data: the target's own continuations of corpus prompts (mostly greedy, some sampled), so the drafter learns what
*this* target says. Per sequence, random anchors a in the continuation; each anchor's block is [x_a, M x (bs-1)] at
positions a..a+bs-1; it sees the target context strictly before a and its whole block, no other block; slot k
predicts x_{a+k} (same position) with weight exp(-(k-1)/gamma); slot 0 has no loss. The target, its embedding and
its LM head stay frozen: only fc, hidden_norm, the layers and norm train.

    dflash-jax train-drafter           # reproduces checkpoints/drafter (resumable: rerun the same command)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.orbax_folder import save
from dflash_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.models.drafter import Drafter, block_pass, context_kv, embed_block, head_logits, init_drafter
from dflash_jax.decode.programs import generate, generate_autoregressive
from dflash_jax.params import abstract_drafter, from_named, named_leaves
from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.quant.nvfp4 import NVFP4Array
from dflash_jax.io.shipped import smollm2_path
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.train import corpus, instructions
from dflash_jax.train.repetition import seq_rep_n
from dflash_jax.train.loop import OptimConfig, batch_rng, cross_entropy, load_training_tokenizer, run

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(block_size: int) -> float:
    return GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))


def shipped_drafter_config(target_cfg: TargetConfig, mask_token_id: int, *, layers: int = 1, block_size: int = 16,
                           taps: int = 3, tap_ids=None) -> DrafterConfig:
    model = target_cfg.drafter_stack(layers)  # Qwen3 layers, whatever the target's family
    ids = tuple(tap_ids) if tap_ids else default_target_layer_ids(target_cfg.num_hidden_layers, taps)
    return DrafterConfig(model=model, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                         num_target_layers=target_cfg.num_hidden_layers)


# -- data ----------------------------------------------------------------------------------------------------------

def make_sequences(target: Target, prompts: list[list[int]], *, max_new_tokens: int, seq_len: int,
                   sampled_fraction: float = 0.2, temperature: float = 0.8, batch: int = 64, seed: int = 0,
                   eos_ids=()) -> dict[str, np.ndarray]:
    """The target's continuations of prompts: tokens [N, seq_len] (0-padded), lengths [N], prompt_lens [N]."""
    n = len(prompts)
    n_sampled = int(round(n * sampled_fraction))
    rows, lens, plens = [], [], []
    for i in range(0, n, batch):
        chunk = prompts[i:i + batch]
        temp = temperature if i >= n - n_sampled else 0.0
        res = generate_autoregressive(target, chunk, max_new_tokens=max_new_tokens, temperature=temp,
                                      eos_ids=eos_ids, seed=seed + i)
        for p, out in zip(chunk, res.token_lists()):
            seq = (list(p) + out)[:seq_len]
            rows.append(seq + [0] * (seq_len - len(seq)))
            lens.append(len(seq))
            plens.append(min(len(p), seq_len))
    return {"tokens": np.asarray(rows, np.int32), "lengths": np.asarray(lens, np.int32),
            "prompt_lens": np.asarray(plens, np.int32)}


def sample_anchors(lengths: np.ndarray, prompt_lens: np.ndarray, num_anchors: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per row up to num_anchors distinct sorted anchors in [prompt_len, length-2]; (anchors [B, N], keep [B, N])."""
    B = len(lengths)
    anchors = np.zeros((B, num_anchors), np.int32)
    keep = np.zeros((B, num_anchors), bool)
    for b in range(B):
        lo, hi = int(prompt_lens[b]), int(lengths[b]) - 2  # an anchor needs at least one label after it
        if hi < lo:
            continue
        k = min(num_anchors, hi - lo + 1)
        pick = np.sort(rng.choice(np.arange(lo, hi + 1), size=k, replace=False))
        anchors[b, :k], keep[b, :k] = pick, True
    return anchors, keep


# -- loss ----------------------------------------------------------------------------------------------------------

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

    h = block_pass(drafter, embed_block(drafter, target, block), positions,
                   [kv[0] for kv in ctx_kv], [kv[1] for kv in ctx_kv], ctx_len, mask=sees_blk)
    return h.reshape(B, N, bs, -1)[:, :, 1:], target  # slots 1..bs-1


def training_logits(params, batch, cfg: DrafterConfig, target_cfg: TargetConfig) -> jax.Array:
    """Logits [B, N, bs-1, V] of block slots 1..bs-1 for every anchor (see `training_hidden`); output_multiplier
    and final_logit_softcapping applied as at inference."""
    h, target = training_hidden(params, batch, cfg, target_cfg)
    return head_logits(Drafter(params=params, config=cfg), target, h, full_vocabulary=True)  # [B, N, bs-1, V]


def training_labels(batch, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Same-position labels: slot k of anchor a predicts x_{a+k}. Returns (labels, valid) [B, N, bs-1]."""
    tokens, lengths, anchors, keep = batch["tokens"], batch["lengths"], batch["anchors"], batch["keep"]
    B, S = tokens.shape
    label_pos = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)[None, None, :]
    valid = keep[:, :, None] & (label_pos < lengths[:, None, None])
    labels = jnp.take_along_axis(tokens, jnp.minimum(label_pos, S - 1).reshape(B, -1), axis=1)
    return labels.reshape(label_pos.shape), valid


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


def drafter_loss(cfg: DrafterConfig, target_cfg: TargetConfig, gamma: float | None = None,
                 vocab_ids: np.ndarray | None = None):
    """loss_fn(drafter_params, batch): decay-weighted CE over many blocks per sequence in one forward.

    vocab_ids: take the softmax over these tokens only (`loss_vocabulary`: every token the training data contains,
    so every label is among them). The target's LM head (V x H, frozen) is most of a step's FLOPs for a small
    drafter (SmolLM2: 49,152 x 576 against a 4.5M-parameter drafter), and an instruct model's answers use a small
    part of its vocabulary, so this cuts the step several times. The drafter still drafts over the full head: a
    token outside the set only costs acceptance, never correctness, and held-out tau (measured by real decoding
    over the full vocabulary) shows what the restriction costs."""
    bs = cfg.block_size
    gamma = decay_gamma(bs) if gamma is None else gamma
    weights = jnp.exp(-jnp.arange(bs - 1, dtype=jnp.float32) / gamma)  # slot k=1..bs-1 -> exp(-(k-1)/gamma)
    if vocab_ids is not None:
        vocab = jnp.asarray(vocab_ids, jnp.int32)  # [Vs]
        to_sub = jnp.full((target_cfg.vocab_size,), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0]))

    def loss_fn(params, batch):
        labels, valid = training_labels(batch, bs)
        h, target = training_hidden(params, batch, cfg, target_cfg)
        if vocab_ids is not None:
            target = restricted_head(target, vocab)
            labels = to_sub[labels]
            valid = valid & (labels >= 0)
            labels = jnp.maximum(labels, 0)
        # as `training_logits`
        logits = head_logits(Drafter(params=params, config=cfg), target, h, full_vocabulary=True)
        ce = cross_entropy(logits, labels)
        w = weights[None, None, :] * valid
        loss = jnp.sum(w * ce) / (jnp.sum(w) + 1e-6)
        correct = (jnp.argmax(logits, axis=-1) == labels) & valid
        acc = jnp.sum(correct) / jnp.maximum(jnp.sum(valid), 1)
        acc1 = jnp.sum(correct[:, :, 0]) / jnp.maximum(jnp.sum(valid[:, :, 0]), 1)
        return loss, {"acc": acc, "acc_slot1": acc1}

    return loss_fn


def target_features(target: Target, tokens: np.ndarray, layer_ids, *, batch: int = 8,
                    out: np.ndarray | None = None) -> np.ndarray:
    """The frozen target's tapped features [N, S, K*H] (float16) of every training sequence, computed once.

    WHY once: the target does not train, and on long sequences its forward costs more than the drafter's whole
    training step. float16 keeps 11 mantissa bits of the residual stream (the drafter's first op is a matmul).
    """
    layer_ids = tuple(layer_ids)
    fwd = jax.jit(lambda t, x: forward_with_cache(t, x, None, layer_ids)[1])
    n, S = tokens.shape
    width = len(layer_ids) * target.config.hidden_size
    out = np.zeros((n, S, width), np.float16) if out is None else out
    for i in range(0, n, batch):
        chunk = tokens[i:i + batch]
        if len(chunk) < batch:  # one program shape: pad the last chunk
            chunk = np.concatenate([chunk, np.zeros((batch - len(chunk), S), chunk.dtype)])
        feats = np.asarray(fwd(target, jnp.asarray(chunk)), np.float32)
        out[i:i + batch] = feats[:min(batch, n - i)].astype(np.float16)
    return out


def make_batch_fn(data: dict[str, np.ndarray], target_params, *, batch: int, num_anchors: int, seed: int):
    """batch_fn(step): a pure function of the step (resume-safe); uses data["features"] when present."""
    def batch_fn(step):
        rng = batch_rng(seed, step)
        idx = np.sort(rng.choice(len(data["tokens"]), size=batch, replace=False))
        anchors, keep = sample_anchors(data["lengths"][idx], data["prompt_lens"][idx], num_anchors, rng)
        out = {"tokens": jnp.asarray(data["tokens"][idx]), "lengths": jnp.asarray(data["lengths"][idx]),
               "anchors": jnp.asarray(anchors), "keep": jnp.asarray(keep), "target": target_params}
        if data.get("features") is not None:
            out["features"] = jnp.asarray(data["features"][idx])
        return out
    return batch_fn


def measure_tau(target: Target, drafter: Drafter, prompts: list[list[int]], *, max_new_tokens: int = 128,
                draft_length: int | None = None, eos_ids=()) -> dict:
    res = generate(target, drafter, prompts, max_new_tokens=max_new_tokens, draft_length=draft_length,
                   eos_ids=eos_ids)  # () by default: tau over whole budgets, as measured before EOS became
                   # the default; an instruct target's answers end at its EOS
    # seq-rep-4 of the (greedy) answers themselves: whether the target loops on these prompts, which inflates tau
    reps = [seq_rep_n(t, 4) for t in res.token_lists()]
    return {"tau": res.tau, "acceptance_rate": res.acceptance_rate,
            "seq_rep4_median": round(float(statistics.median(reps)), 4) if reps else None,
            "position_acceptance": [round(float(x), 4) for x in res.position_acceptance]}


def training_prompts(n: int, seed: int, *, packages: bool) -> list[str]:
    """Prompts from the TRAIN split of the corpus (stdlib + corpus packages), never from held-out files."""
    if not packages:
        return corpus.train_prompts(n, seed=seed)
    train, _, _ = corpus.build_corpus(packages=True)
    return corpus._sample_prompts([f.text for f in train], n, seed, 100, 300, 0.5, 64)


def target_fingerprint(target: Target) -> str:
    """sha256 (16 hex digits) of the target's config and weights: names the target a data cache was made with.

    The config enters as its fields that differ from their defaults, so that a config field added later (with a
    default that keeps old models as they were) does not orphan every data cache made before it."""
    cfg = target.config
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default}
    h = hashlib.sha256(repr(sorted(changed.items())).encode())
    for leaf in jax.tree.leaves(target.params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def chat_prompt_ids(tok, n: int, *, split: str, seed: int, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """`n` instruction requests of the corpus `split` through the tokenizer's chat template (see
    `train.instructions`); requests whose prompt exceeds max_prompt_tokens are replaced by further ones (a chat
    prompt cannot be cut without breaking its template)."""
    ids: list[list[int]] = []
    extra = 0
    while len(ids) < n:
        requests = instructions.instruction_requests(n + extra, split=split, seed=seed)
        ids = [p for p in instructions.chat_prompts(tok, requests)
               if max_prompt_tokens is None or len(p) <= max_prompt_tokens][:n]
        extra += max(8, n // 8)
    return ids


def build_data(target: Target, tok, cfg: DrafterConfig, work: Path, *, prompts: int, new_tokens: int,
               max_prompt_tokens: int, sampled_fraction: float, sample_temperature: float, seed: int,
               packages: bool, chat: bool = False) -> dict[str, np.ndarray]:
    """Target continuations and their tapped features, cached in `work` (the data is the expensive part).

    chat: the target is an instruct model: its answers (until its EOS) to instruction requests through its own chat
    template (`chat_prompt_ids`), instead of continuations of corpus code."""
    tag = f"{prompts}_{new_tokens}_{max_prompt_tokens}_{sampled_fraction}_{sample_temperature}_{seed}_{int(packages)}"
    tag += "_chat" if chat else ""
    seq_file, feat_file = work / f"sequences_{tag}.npz", work / f"features_{tag}_{'-'.join(map(str, cfg.target_layer_ids))}.npy"
    seq_len = max_prompt_tokens + new_tokens
    # The cache is named by the data flags alone, so a retrained target would silently reuse the old target's
    # continuations (e.g. a second drafter trained with --data-dir on the first one's work dir): each cache file
    # records the target it was made with, and a different target is refused.
    stamp_file, stamp = work / f"sequences_{tag}.target.txt", target_fingerprint(target)
    if seq_file.exists() and stamp_file.exists() and stamp_file.read_text().strip() != stamp:
        raise corpus.CorpusError(
            f"{seq_file} was made with a different target (fingerprint {stamp_file.read_text().strip()}, this "
            f"target {stamp}): use another --work-dir / --data-dir or delete the cached sequences and features")
    if seq_file.exists():
        data = dict(np.load(seq_file))
        if not stamp_file.exists():  # a cache from before the stamps: cannot be checked
            print(f"warning: {seq_file} records no target; reusing it as made with this target", flush=True)
    else:
        t0 = time.perf_counter()
        if chat:
            ids = chat_prompt_ids(tok, prompts, split="train", seed=seed, max_prompt_tokens=max_prompt_tokens)
        else:
            ids = [tok.encode(t)[-max_prompt_tokens:] for t in training_prompts(prompts, seed, packages=packages)]
        data = make_sequences(target, ids, max_new_tokens=new_tokens, seq_len=seq_len,
                              sampled_fraction=sampled_fraction, temperature=sample_temperature, seed=seed,
                              eos_ids=(tok.eos_id,))
        np.savez(seq_file, **data)
        stamp_file.write_text(stamp + "\n")
        print(f"drafter data: {len(ids)} target continuations, "
              f"{int((data['lengths'] - data['prompt_lens']).sum()):,} generated tokens in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    if not feat_file.exists():
        t0 = time.perf_counter()
        tmp = feat_file.with_suffix(".partial.npy")
        width = cfg.num_taps * target.config.hidden_size
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=data["tokens"].shape + (width,))
        target_features(target, data["tokens"], cfg.target_layer_ids, out=out)
        out.flush()
        del out
        tmp.rename(feat_file)
        print(f"target features: {feat_file.stat().st_size / 2 ** 30:.2f} GiB in {time.perf_counter() - t0:.0f}s",
              flush=True)
    data["features"] = np.load(feat_file, mmap_mode="r")
    return data


def warm_start(cfg: DrafterConfig, fresh, source: Drafter, *, exact: bool = False):
    """`fresh` params with every tensor of the `source` drafter copied in (a DFlash drafter into a DFlash2 one
    fills the layers they share). exact: `source` must have every tensor `fresh` has (a warm start of the same
    kind). A tensor that does not fit is named."""
    named = dict(named_leaves(fresh))
    theirs = named_leaves(source.params)
    for name, leaf in theirs.items():
        if name not in named or tuple(named[name].shape) != tuple(leaf.shape):
            raise ValueError(f"--init-from: tensor {name} {tuple(leaf.shape)} does not fit this "
                             f"{cfg.kind} drafter")
        named[name] = jnp.asarray(leaf, named[name].dtype)
    if exact and set(theirs) != set(named):
        raise ValueError(f"--init-from: the drafter lacks {sorted(set(named) - set(theirs))[:4]} "
                         f"(it is not a {cfg.kind} drafter of this layout)")
    return from_named(abstract_drafter(cfg), named)


def add_training_arguments(ap, *, out, work_dir, work_help):
    """The flags every drafter trainer shares: what to train against, the data recipe, the optimizer."""
    ap.add_argument("--target", default=str(CHECKPOINTS / "target"),
                    help="the frozen target: a folder, a .gguf file, or 'smollm2' (the packaged SmolLM2 GGUF)")
    ap.add_argument("--tokenizer", default=str(CHECKPOINTS / "tokenizer.json"), help="tokenizer.json")
    ap.add_argument("--out", default=str(out), help="where the trained drafter is saved")
    ap.add_argument("--work-dir", default=work_dir, help=work_help)
    ap.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    ap.add_argument("--block-size", type=int, default=16, help="block size (drafted tokens + 1)")
    ap.add_argument("--taps", type=int, default=3, help="number of target layers feeding fc")
    ap.add_argument("--tap-ids", type=int, nargs="+", default=None,
                    help="target layers feeding fc (default: the z-lab rule for --taps taps)")
    ap.add_argument("--prompts", type=int, default=1024, help="training prompts (target continuations)")
    ap.add_argument("--new-tokens", type=int, default=1024, help="tokens the target generates per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=128, help="prompts are cut to their last N tokens")
    ap.add_argument("--sampled-fraction", type=float, default=0.25,
                    help="fraction of continuations sampled (the rest greedy)")
    ap.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of the sampled ones")
    ap.add_argument("--no-packages", action="store_true", help="prompts from the stdlib alone (no [corpus] extra)")
    ap.add_argument("--chat", action="store_true",
                    help="an instruct target: train on its answers (until EOS) to instruction requests made from the "
                         "corpus, through its chat template; evaluate on held-out requests")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="the drafter's mask token (default: the tokenizer's <|mask|>, else <|endoftext|>)")
    ap.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--anchors", type=int, default=64, help="random anchors (blocks) per sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--eval-every", type=int, default=500, help="tau evaluation interval (steps); 0 = none")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for tau")
    ap.add_argument("--eval-tokens", type=int, default=256, help="new tokens per tau evaluation prompt")
    ap.add_argument("--ckpt-every", type=int, default=100, help="orbax checkpoint interval (steps), for resume")
    ap.add_argument("--seed", type=int, default=0, help="data and init seed")


def eval_prompts_and_length(tok, cfg: DrafterConfig, args) -> tuple[list[list[int]], int]:
    """--eval-prompts held-out prompts (seed 1, never trained on: held-out code, or with --chat held-out
    instruction requests through the chat template) and the draft length tau is reported at (7, or the block's
    whole draft when it is shorter)."""
    if args.chat:
        prompts = chat_prompt_ids(tok, args.eval_prompts, split="eval", seed=1)
    else:
        prompts = [tok.encode(t) for t in corpus.held_out_prompts(args.eval_prompts, seed=1)]
    return prompts, min(7, cfg.block_size - 1)


def eval_eos(tok, args) -> tuple[int, ...]:
    """An instruct target's answers end at its EOS (--chat); code continuations run the whole budget."""
    return (tok.eos_id,) if args.chat else ()


def tau_eval_fn(target, cfg: DrafterConfig, prompts, max_new_tokens: int, draft_length: int, eos_ids=()):
    """params -> tau and acceptance of the drafter with those params on `prompts` (the training loop's eval)."""
    def eval_fn(params):
        return {k: v for k, v in measure_tau(target, Drafter(params=params, config=cfg), prompts,
                                             max_new_tokens=max_new_tokens, draft_length=draft_length,
                                             eos_ids=eos_ids).items()
                if k != "position_acceptance"}
    return eval_fn


def train_and_save(cfg: DrafterConfig, target, data: dict, args, work: Path, loss_fn, eval_fn, *, desc: str,
                   exact_warm_start: bool, draft_vocab: int = 0) -> tuple[Drafter, list[dict]]:
    """The run both drafter kinds share: fresh params (or --init-from's, see `warm_start`), the training loop over
    the shared flags (orbax checkpoints and log under `work`, so a rerun resumes), saved to --out (drafting over
    the first `draft_vocab` ids when > 0: an inference setting, so training itself does not see it)."""
    params = init_drafter(cfg, jax.random.key(args.seed + 1)).params
    if args.init_from:
        params = warm_start(cfg, params, load_drafter(args.init_from), exact=exact_warm_start)
    optim = OptimConfig(steps=args.steps, lr=args.lr, weight_decay=0.0)
    params, history = run(params=params, loss_fn=loss_fn,
                          batch_fn=make_batch_fn(data, target.params, batch=args.batch, num_anchors=args.anchors,
                                                 seed=args.seed),
                          optim=optim, ckpt_dir=work / "ckpt", eval_fn=eval_fn, eval_every=args.eval_every,
                          ckpt_every=args.ckpt_every, desc=desc, log_file=work / "log.jsonl")
    drafter = Drafter(params=params, config=cfg.replace(draft_vocab_size=draft_vocab or None))
    save(args.out, drafter)
    return drafter, history


def write_report(out, report: dict, t_start: float, drafter: Drafter) -> dict:
    """The trainer's report, completed with this invocation's wall time and the drafter's parameter count: written
    to <out>/train_report.json and printed."""
    report.update(wall_time_s_this_invocation=round(time.perf_counter() - t_start, 1),
                  params=int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(drafter.params))))
    with open(Path(out) / "train_report.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return report


def resolve_target_and_tokenizer(args) -> None:
    """--target smollm2 is the packaged SmolLM2-135M-Instruct GGUF; a GGUF target brings its own tokenizer unless
    --tokenizer names another one."""
    if args.target == "smollm2":
        args.target = str(smollm2_path())
    if str(args.target).endswith(".gguf") and args.tokenizer == str(CHECKPOINTS / "tokenizer.json"):
        args.tokenizer = args.target


def mask_token_id(tok, args) -> int:
    """--mask-token-id, else the tokenizer's mask token, else <|endoftext|>: a token that never occurs in a block's
    context (the drafter reads its embedding as "to be predicted")."""
    if args.mask_token_id is not None:
        return int(args.mask_token_id)
    mask = getattr(tok, "mask_id", None)
    if mask is None and hasattr(tok, "token_to_id"):
        mask = tok.token_to_id("<|endoftext|>")
    if mask is None:
        raise SystemExit("error: the tokenizer has no <|mask|> or <|endoftext|> token: pass --mask-token-id")
    return int(mask)


def build_data_or_exit(target, tok, cfg, data_dir, args):
    """build_data from the shared flags; a missing corpus is a message, not a traceback."""
    try:
        return build_data(target, tok, cfg, data_dir, prompts=args.prompts, new_tokens=args.new_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, sampled_fraction=args.sampled_fraction,
                          sample_temperature=args.sample_temperature, seed=args.seed,
                          packages=not args.no_packages, chat=args.chat)
    except corpus.CorpusError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="dflash-jax train-drafter",
                                 description="Train the shipped DFlash drafter for the shipped target")
    add_training_arguments(ap, out=CHECKPOINTS / "drafter", work_dir=".train/drafter",
                           work_help="data cache, orbax checkpoints (resume) and logs")
    ap.add_argument("--init-from", default=None,
                    help="start from this DFlash drafter folder (same layout), e.g. one trained for an earlier "
                         "version of the target")
    ap.add_argument("--loss-vocab", choices=("full", "data"), default="full",
                    help="softmax of the training loss over the full vocabulary, or only over the tokens the "
                         "training data contains (several times cheaper steps when the target's vocabulary is "
                         "large and its answers use little of it; drafting always uses the full vocabulary)")
    ap.add_argument("--loss-vocab-first-ids", type=int, default=8192,
                    help="with --loss-vocab data, also every token id below this (a BPE vocabulary's common pieces, "
                         "as negatives)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the saved drafter drafts over the first N token ids only (its config's draft_vocab_size; "
                         "0 = the whole vocabulary). Training is unchanged; the final held-out tau is measured with "
                         "it (the periodic evaluations draft over the whole vocabulary)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    resolve_target_and_tokenizer(args)
    tok = load_training_tokenizer(args.tokenizer)
    target = load_target(args.target, compute_dtype="float32")
    if not 0 <= args.draft_vocab <= target.config.vocab_size:  # refused before any work
        raise SystemExit(f"--draft-vocab {args.draft_vocab}: must be 1..{target.config.vocab_size} (0: all)")
    cfg = shipped_drafter_config(target.config, mask_token_id(tok, args), layers=args.layers, block_size=args.block_size,
                                 taps=args.taps, tap_ids=args.tap_ids)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = build_data_or_exit(target, tok, cfg, work, args)
    eval_prompts, d7 = eval_prompts_and_length(tok, cfg, args)
    vocab_ids = (loss_vocabulary(data, min(args.loss_vocab_first_ids, target.config.vocab_size))
                 if args.loss_vocab == "data" else None)
    if vocab_ids is not None:
        print(f"loss vocabulary: {len(vocab_ids):,} of {target.config.vocab_size:,} tokens (those in the training "
              f"data and ids < {args.loss_vocab_first_ids})", flush=True)
    drafter, history = train_and_save(cfg, target, data, args, work, drafter_loss(cfg, target.config,
                                                                                  vocab_ids=vocab_ids),
                                      tau_eval_fn(target, cfg, eval_prompts, args.eval_tokens, d7, eval_eos(tok, args)),
                                      desc="drafter", exact_warm_start=True, draft_vocab=args.draft_vocab)
    final = measure_tau(target, drafter, eval_prompts, max_new_tokens=args.eval_tokens, draft_length=d7,
                        eos_ids=eval_eos(tok, args))
    report = {"command": "dflash-jax train-drafter " + " ".join(argv or []), "steps": args.steps,
              "layers": args.layers, "batch": args.batch, "anchors_per_sequence": args.anchors,
              "prompts": args.prompts, "new_tokens": args.new_tokens,
              "generated_tokens": int((data["lengths"] - data["prompt_lens"]).sum()),
              "sampled_fraction": args.sampled_fraction, "sample_temperature": args.sample_temperature,
              "gamma": decay_gamma(args.block_size), "init_from": args.init_from,
              "loss_vocab": len(vocab_ids) if vocab_ids is not None else target.config.vocab_size,
              "draft_vocab": drafter.config.drafted_vocab,
              "train_loss": history[-1]["loss"] if history else None,
              "train_acc": history[-1].get("acc") if history else None,
              f"tau_eval_{len(eval_prompts)}_prompts_{args.eval_tokens}_tokens_D{d7}": final["tau"],
              "acceptance_rate_eval": final["acceptance_rate"], "seq_rep4_median_eval": final["seq_rep4_median"]}
    write_report(args.out, report, t_start, drafter)


if __name__ == "__main__":
    main()
