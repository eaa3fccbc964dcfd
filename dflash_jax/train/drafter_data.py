"""The DFlash drafter's training data: the frozen target's own continuations of corpus prompts (mostly greedy,
some sampled; for an instruct target its answers to held-out-free instruction requests through its chat template),
their tapped target features computed once, and the batches of random anchors the loss is taken at. Cached in the
work folder under the data flags, stamped with the target it was made with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig
from dflash_jax.decode.programs import generate_autoregressive
from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.quant import ggml
from dflash_jax.train import corpus, instructions
from dflash_jax.train.loop import batch_rng


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
    # GGML blocks enter as the float32 values they hold: a GGUF target kept in blocks and the same file loaded as
    # float32 are one target (the same values, the same data), whichever way it was loaded when the data was made
    values = jax.tree.map(lambda x: ggml.dequantize(x) if isinstance(x, ggml.GGMLArray) else x, target.params,
                          is_leaf=lambda x: isinstance(x, ggml.GGMLArray))
    for leaf in jax.tree.leaves(values):
        arr = np.asarray(leaf)
        if arr.dtype.kind not in "iub":  # -0.0 and +0.0 are one value (a Q4_0 block decoded as (q - 8) * d gives -0.0)
            arr = np.where(arr == 0, np.zeros_like(arr), arr)
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def chat_prompt_ids(tok, n: int, *, split: str, seed: int, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """`n` instruction requests of the corpus `split` through the tokenizer's chat template (see
    `train.instructions`); requests whose prompt exceeds max_prompt_tokens are replaced by further ones (a chat
    prompt cannot be cut without breaking its template)."""
    ids: list[list[int]] = []
    extra = 0
    while len(ids) < n:
        requests = instructions.instruction_requests(n + extra, split=split, seed=seed)
        prompts = instructions.chat_prompts(tok, requests)
        ids = [p for p in prompts if max_prompt_tokens is None or len(p) <= max_prompt_tokens][:n]
        if not ids:  # more requests cannot help: each draw re-reads the split, so say it at once
            raise ValueError(f"max_prompt_tokens {max_prompt_tokens}: none of {len(prompts)} {split} requests fits "
                             f"through the chat template (the shortest takes {min(map(len, prompts))} tokens)")
        extra = max(8, n // 8) if not extra else 2 * extra  # doubling: a few draws even when most prompts are long
    return ids


def build_data(target: Target, tok, cfg: DrafterConfig, work: Path, *, prompts: int, new_tokens: int,
               max_prompt_tokens: int, sampled_fraction: float, sample_temperature: float, seed: int,
               packages: bool, chat: bool = False) -> dict[str, np.ndarray]:
    """Target continuations and their tapped features, cached in `work` (the data is the expensive part).

    chat: the target is an instruct model: its answers (until its EOS) to instruction requests through its own chat
    template (`chat_prompt_ids`), instead of continuations of corpus code."""
    tag = f"{prompts}_{new_tokens}_{max_prompt_tokens}_{sampled_fraction}_{sample_temperature}_{seed}_{int(packages)}"
    tag += "_chat" if chat else ""
    taps = "-".join(map(str, cfg.target_layer_ids))
    seq_file, feat_file = work / f"sequences_{tag}.npz", work / f"features_{tag}_{taps}.npy"
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
        for key in ("labels", "agree"):  # the target's predictions over existing text (`train.text_data`)
            if key in data:
                out[key] = jnp.asarray(data[key][idx])
        return out
    return batch_fn


def build_data_or_exit(target, tok, cfg, data_dir, args):
    """build_data from the shared flags; a missing corpus is a message, not a traceback."""
    try:
        return build_data(target, tok, cfg, data_dir, prompts=args.prompts, new_tokens=args.new_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, sampled_fraction=args.sampled_fraction,
                          sample_temperature=args.sample_temperature, seed=args.seed,
                          packages=not args.no_packages, chat=args.chat)
    except corpus.CorpusError as e:
        raise SystemExit(f"error: {e}") from None


__all__ = ["make_sequences", "sample_anchors", "training_prompts", "target_fingerprint", "chat_prompt_ids",
           "build_data", "target_features", "make_batch_fn", "build_data_or_exit"]
