"""The DFlash drafter trainer's run (`dflash-jax train-drafter`, flags in `train.drafter`): data from a datagen
work dir (`--data-dir`, read through a data plan that survives resumes while the data grows: `train.shard_stream`)
or the trainer's own cached continuations; exact resume from the work dir, in chunks (`--stop-at`, or SIGTERM)
that chain into one schedule; data parallel over a mesh of one or several processes (`train.data_parallel`);
held-out tau at each listed draft length when an invocation ends; the drafter and its report saved to --out.

    dflash-jax train-drafter --chat --target smollm2 --data-dir /work/data/smollm2_answers --block-size 8 \\
        --steps 20000 --stop-at 2000 --work-dir .train/smol_big --out .train/smol_big_out   # rerun: next chunk
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dflash_jax.io.checkpoint import load_target
from dflash_jax.io.orbax_folder import save
from dflash_jax.models.drafter import Drafter, init_drafter
from dflash_jax.train import data_parallel as dp
from dflash_jax.train import shard_stream as ss
from dflash_jax.train.datagen import vocabulary_fingerprint
from dflash_jax.train.drafter import (CHECKPOINTS, add_training_arguments, eval_eos, eval_prompts_and_length,
                                      init_from_target, load_drafter, mask_token_id, measure_tau,
                                      replayed_batches_warning, resolve_target_and_tokenizer,
                                      shipped_drafter_config, warm_start)
from dflash_jax.train.drafter2 import drafter2_loss, shipped_drafter2_config
from dflash_jax.train.drafter_data import build_data_or_exit, make_batch_fn, target_fingerprint
from dflash_jax.train.drafter_loss import decay_gamma, drafter_loss, loss_vocabulary
from dflash_jax.train.loop import OptimConfig, load_training_tokenizer, run
from dflash_jax.train.run_record import RunMismatch, check_or_record
from dflash_jax.train.shards import DataError
from dflash_jax.train.text_data import build_text_data


def loss_vocab_ids(args, work: Path, data: dict | None, vocab_size: int):
    """The loss vocabulary of --loss-vocab: None (full), the first --draft-vocab ids ("draft"), or the data's tokens
    plus the low ids ("data"), fixed when the run starts (<work>/loss_vocab.npy) so that data added later does not
    change the loss of a resumed run."""
    if args.loss_vocab == "full":
        return None
    if args.loss_vocab == "draft":
        if not args.draft_vocab:
            raise SystemExit("error: --loss-vocab draft needs --draft-vocab N (the draft vocabulary)")
        return np.arange(args.draft_vocab, dtype=np.int32)
    path = work / "loss_vocab.npy"
    if path.exists():
        return np.load(path)
    ids = loss_vocabulary(data, min(args.loss_vocab_first_ids, vocab_size))
    if jax.process_index() == 0:
        np.save(path, ids)
    return ids


def trimmed_target_params(target, cfg, keep_top: bool):
    """The target parameters the loss reads: embedding, final norm, LM head, and (for a KL teacher) the layers
    after the deepest tap; the rest are left out of every step's arguments."""
    top = max(cfg.target_layer_ids)
    layers = tuple(layer if keep_top and i > top else None for i, layer in enumerate(target.params.layers))
    return dataclasses.replace(target.params, layers=layers)


def tokens_seen(plan, data: dict, steps: int, batch: int) -> int:
    """Answer tokens the first `steps` steps read (expected: each segment's steps x batch x its mean answer)."""
    answer = data["lengths"] - data["prompt_lens"]
    total = 0.0
    for k, seg in enumerate(plan):
        end = plan[k + 1].start if k + 1 < len(plan) else steps
        total += max(0, min(end, steps) - seg.start) * batch * float(answer[:seg.rows].mean())
    return int(total)


def _resuming(work: Path) -> bool:
    ckpt = work / "ckpt"
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def train_drafter(args, argv) -> dict:
    if args.grow and not args.init_from:  # refused before any work
        raise SystemExit("error: --grow needs --init-from (the drafter to grow)")
    t_start = time.perf_counter()
    dp.init_distributed(args)  # before anything touches a device
    lead = jax.process_index() == 0
    resolve_target_and_tokenizer(args)
    tok = load_training_tokenizer(args.tokenizer)
    gguf = str(args.target).endswith(".gguf")  # dequantized: the data's fingerprint is the float32 target's
    target = load_target(args.target, compute_dtype="float32", param_dtype="float32" if gguf else None)
    if not 0 <= args.draft_vocab <= target.config.vocab_size:  # refused before any work
        raise SystemExit(f"--draft-vocab {args.draft_vocab}: must be 1..{target.config.vocab_size} (0: all)")
    if args.kind == "dflash2":  # DFlash's layout plus the grouped convolutions and the candidate selector
        cfg = shipped_drafter2_config(target.config, mask_token_id(tok, args), layers=args.layers,
                                      block_size=args.block_size, taps=args.taps, tap_ids=args.tap_ids,
                                      selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    else:
        cfg = shipped_drafter_config(target.config, mask_token_id(tok, args), layers=args.layers,
                                     block_size=args.block_size, taps=args.taps, tap_ids=args.tap_ids)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    mesh = dp.make_training_mesh(args)
    dp.check_batch(args.batch, mesh)
    fingerprint, vocab_fp = target_fingerprint(target), vocabulary_fingerprint(tok)

    shards_dir = Path(args.data_dir) if args.data_dir and ss.is_datagen_dir(args.data_dir) else None
    if shards_dir is not None and args.text_answers:
        raise SystemExit("error: --text-answers makes its own data: give it no datagen --data-dir")
    data, spec = None, None
    try:
        if shards_dir is not None:
            spec = ss.data_spec(shards_dir, target_fingerprint=fingerprint, vocabulary=vocab_fp,
                                layer_ids=cfg.target_layer_ids)
            entries, rows = ss.complete_shards(shards_dir, spec, args.max_data_tokens)
            if not rows:
                raise DataError(f"{shards_dir} holds no complete shard yet")
            first = ss.open_rows(shards_dir, entries, rows, spec, cfg.target_layer_ids)
        elif args.text_answers:
            data = build_text_data(target, tok, cfg.target_layer_ids, work, n=args.text_answers, seed=args.seed,
                                   max_prompt_tokens=args.max_prompt_tokens, max_answer_tokens=args.new_tokens)
        else:
            data_dir = Path(args.data_dir) if args.data_dir else work
            data_dir.mkdir(parents=True, exist_ok=True)  # a fresh --data-dir holds the cached continuations
            data = build_data_or_exit(target, tok, cfg, data_dir, args)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    vocab_ids = loss_vocab_ids(args, work, data if data is not None else first, target.config.vocab_size)

    record = {"kind": cfg.kind, "block_size": cfg.block_size, "layers": args.layers,
              "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
              "target": fingerprint, "vocabulary": vocab_fp, "vocab_size": target.config.vocab_size,
              "data": str(shards_dir.resolve()) if shards_dir else (f"text {args.text_answers}" if args.text_answers
                                                                    else "cached continuations"),
              "max_data_tokens": args.max_data_tokens, "loss_vocab": args.loss_vocab, "kl_weight": args.kl_weight,
              "steps": args.steps, "lr": args.lr, "batch": args.batch, "anchors": args.anchors, "seed": args.seed,
              "init": args.init_from or args.init, **({"grow": True} if args.grow else {})}
    try:
        if lead:
            resuming = _resuming(work)
            warning = None if resuming or not args.init_from else replayed_batches_warning(args.init_from, shards_dir,
                                                                                           args.seed)
            if warning:
                print(warning, flush=True)
            check_or_record(work, record, resuming=resuming)
    except RunMismatch as e:
        raise SystemExit(f"error: {e}") from None

    params = init_drafter(cfg, jax.random.key(args.seed + 1)).params
    if args.init == "target":
        params = init_from_target(cfg, params, target)
    if args.init_from:
        source = load_drafter(args.init_from)  # a DFlash drafter fills a DFlash2 one's shared tensors
        params = warm_start(cfg, params, source, exact=source.config.kind == cfg.kind, grow=args.grow)
    tparams = trimmed_target_params(target, cfg, keep_top=bool(args.kl_weight))
    placement = None
    if mesh is not None:
        placement = dp.placement_for(Drafter(params=params, config=cfg), mesh)
        tparams = dp.place_replicated(tparams, mesh)

    state = {}

    def on_start(step: int) -> None:
        if shards_dir is None:
            return
        if lead:  # one process decides the plan (the data may grow meanwhile); the others read it
            entries, rows = ss.complete_shards(shards_dir, spec, args.max_data_tokens)
            ss.update_plan(work, step, entries, rows)
        _sync("data plan")
        plan = ss.read_plan(work)
        plan = [s for s in plan if s.start <= step] or plan
        state["stream"] = ss.ShardStream(shards_dir, plan, spec, cfg.target_layer_ids, batch=args.batch,
                                         num_anchors=args.anchors, seed=args.seed)
        seg = plan[-1]
        if lead:
            print(f"data plan: from step {seg.start}, {seg.rows:,} answers in {len(seg.shards)} shards, "
                  f"{state['stream'].answer_tokens:,} answer tokens", flush=True)

    if shards_dir is None:
        cached = make_batch_fn(data, tparams, batch=args.batch, num_anchors=args.anchors, seed=args.seed)
        batch_fn = ((lambda step: {k: (np.asarray(v) if k != "target" else v) for k, v in cached(step).items()})
                    if placement is not None else cached)
    else:
        def batch_fn(step):
            return {**state["stream"].host_batch(step), "target": tparams}

    eval_prompts, _ = eval_prompts_and_length(tok, cfg, args)
    lengths = [d for d in args.eval_draft_lengths if d < cfg.block_size]

    eval_cfg = cfg.replace(draft_vocab_size=args.draft_vocab or None)  # measured as it will be saved

    def eval_fn(p):
        drafter = Drafter(params=jax.tree.map(jax.numpy.asarray, dp.host_params(p)), config=eval_cfg)
        out = {}
        for d in lengths:
            m = measure_tau(target, drafter, eval_prompts, max_new_tokens=args.eval_tokens, draft_length=d,
                            eos_ids=eval_eos(tok, args))
            suffix = "" if d == max(lengths) else f"_D{d}"  # "tau" is the longest, as the logs always had it
            out.update({f"tau{suffix}": m["tau"], f"acceptance_rate{suffix}": m["acceptance_rate"]})
        return out

    if cfg.is_dflash2:
        if args.kl_weight:
            raise SystemExit("error: --kl-weight is a DFlash loss term; --kind dflash2 trains its base and selector "
                             "losses")
        loss_fn = drafter2_loss(cfg, target.config, selector_weight=args.selector_weight, vocab_ids=vocab_ids)
    else:
        loss_fn = drafter_loss(cfg, target.config, vocab_ids=vocab_ids, kl_weight=args.kl_weight)
    optim = OptimConfig(steps=args.steps, lr=args.lr, weight_decay=0.0)
    params, history = run(params=params, loss_fn=loss_fn, batch_fn=batch_fn, optim=optim, ckpt_dir=work / "ckpt",
                          eval_fn=eval_fn if eval_prompts and lengths else None, eval_every=args.eval_every,
                          ckpt_every=args.ckpt_every, desc="drafter", log_file=work / "log.jsonl",
                          stop_at=args.stop_at, placement=placement, on_start=on_start)

    host = dp.host_params(params)  # numpy: with several processes orbax writes host arrays from process 0
    drafter = Drafter(params=host, config=cfg.replace(draft_vocab_size=args.draft_vocab or None))
    save(args.out, drafter)  # every process takes part (orbax)
    host = jax.tree.map(jax.numpy.asarray, host)
    last = history[-1] if history else {}
    argv = sys.argv[1:] if argv is None else argv  # run as `python -m dflash_jax.train.drafter_run`: its own
    report = {"command": "dflash-jax train-drafter " + " ".join(argv), "steps": args.steps,
              "step": int(last.get("step", -1)) + 1, "cpu_s": last.get("cpu_s"), "wall_s": last.get("wall_s"),
              "layers": args.layers, "block_size": cfg.block_size, "batch": args.batch,
              "anchors_per_sequence": args.anchors, "gamma": decay_gamma(cfg.block_size), "init": record["init"],
              "kl_weight": args.kl_weight, "seed": args.seed, "devices": len(jax.devices()),
              "processes": jax.process_count(),
              "loss_vocab": len(vocab_ids) if vocab_ids is not None else target.config.vocab_size,
              "draft_vocab": drafter.config.drafted_vocab, "train_loss": last.get("loss"),
              "train_acc": last.get("acc"), "train_acc_slot1": last.get("acc_slot1"), "kind": cfg.kind}
    if cfg.is_dflash2:
        report.update({k: last.get(k) for k in ("base_loss", "selector_loss", "selector_acc", "selector_acc_slot1",
                                                "topk_coverage")}, selector_rank=cfg.selector_rank,
                      selector_top_k=cfg.selector_top_k, selector_weight=args.selector_weight)
    if shards_dir is not None:
        stream = state["stream"]
        report.update(data=str(shards_dir), data_answers=len(stream.data["lengths"]),
                      data_answer_tokens=stream.answer_tokens,
                      answer_tokens_seen=tokens_seen(ss.read_plan(work), stream.data, report["step"], args.batch))
    else:
        report.update(prompts=len(data["lengths"]),
                      generated_tokens=int((data["lengths"] - data["prompt_lens"]).sum()))
    if eval_prompts and lengths and history and args.final_eval:
        done = {k: v for k, v in last.items() if k.startswith(("tau", "acceptance_rate"))}  # evaluated at this step
        report.update({f"heldout_{k}": v for k, v in (done or eval_fn(host)).items()})
        if lead:
            with open(work / "log.jsonl", "a") as f:
                f.write(json.dumps({"step": report["step"] - 1, "cpu_s": report["cpu_s"], "final": True,
                                    **{k[8:]: v for k, v in report.items() if k.startswith("heldout_")}}) + "\n")
    report["wall_time_s_this_invocation"] = round(time.perf_counter() - t_start, 1)
    report["params"] = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(drafter.params)))
    if lead:
        with open(Path(args.out) / "train_report.json", "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report, indent=1))
    return report


def main(argv=None):
    """`dflash-jax train-drafter` (DFlash; `--kind dflash2` is `train.drafter2`)."""
    ap = argparse.ArgumentParser(prog="dflash-jax train-drafter",
                                 description="Train the shipped DFlash drafter for the shipped target")
    add_training_arguments(ap, out=CHECKPOINTS / "drafter", work_dir=".train/drafter",
                           work_help="data cache, orbax checkpoints (resume), run record, data plan and logs")
    ap.add_argument("--init-from", default=None,
                    help="start from this DFlash drafter folder (same layout), e.g. one trained for an earlier "
                         "version of the target")
    ap.add_argument("--grow", action="store_true",
                    help="with --init-from: that drafter may have fewer layers than --layers; its layers fill the "
                         "bottom and each added layer starts as the identity (zero o_proj and down_proj)")
    ap.add_argument("--init", choices=("random", "target"), default="random",
                    help="fresh weights: random (std 0.02), or the target's own layers after the deepest tap "
                         "(`init_from_target`)")
    ap.add_argument("--data-dir", default=None,
                    help="a datagen work dir (python -m dflash_jax.train.datagen: its shards are the data, and a "
                         "resumed run sees the shards added since), or a folder for the cached continuations")
    ap.add_argument("--text-answers", type=int, default=0,
                    help="instead of generated answers: N coding requests answered by their function's own source "
                         "(train split), labelled with the target's greedy predictions over that text "
                         "(`train.text_data`)")
    ap.add_argument("--max-data-tokens", type=int, default=None,
                    help="with a datagen --data-dir: only its first answers, up to this many answer tokens")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop this invocation after this many steps (checkpoint saved; rerun to continue the same "
                         "--steps schedule)")
    ap.add_argument("--loss-vocab", choices=("full", "data", "draft"), default="full",
                    help="softmax of the training loss over the full vocabulary, only over the tokens the "
                         "training data contains (several times cheaper steps when the target's vocabulary is "
                         "large and its answers use little of it; drafting always uses the full vocabulary), or "
                         "over the draft vocabulary (--draft-vocab; labels outside it are left out)")
    ap.add_argument("--loss-vocab-first-ids", type=int, default=8192,
                    help="with --loss-vocab data, also every token id below this (a BPE vocabulary's common pieces, "
                         "as negatives)")
    ap.add_argument("--kl-weight", type=float, default=0.0,
                    help="loss = (1-w) CE on the data's tokens + w KL to the target's next-token distribution "
                         "(recomputed from the deepest tap; needs features)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the saved drafter drafts over the first N token ids only (its config's draft_vocab_size; "
                         "0 = the whole vocabulary). Held-out tau is measured with it; the loss is --loss-vocab's")
    ap.add_argument("--eval-draft-lengths", type=int, nargs="+", default=[7],
                    help="held-out tau at these draft lengths (those the block holds)")
    ap.add_argument("--no-final-eval", dest="final_eval", action="store_false",
                    help="no held-out tau when this invocation ends")
    ap.add_argument("--kind", choices=("dflash", "dflash2"), default="dflash",
                    help="dflash2: DFlash's layout plus its grouped convolutions and candidate selector (trained "
                         "with the selector loss of `train.drafter2`; --init-from a DFlash drafter fills the shared "
                         "tensors)")
    ap.add_argument("--selector-rank", type=int, default=64, help="with --kind dflash2: codebook rank (z-lab: 256)")
    ap.add_argument("--selector-top-k", type=int, default=16, help="with --kind dflash2: candidates per slot")
    ap.add_argument("--selector-weight", type=float, default=1.0, help="with --kind dflash2: the selector loss's weight")
    dp.add_mesh_arguments(ap)
    args = ap.parse_args(argv)
    train_drafter(args, argv)


__all__ = ["main", "train_drafter", "loss_vocab_ids", "trimmed_target_params", "tokens_seen"]


if __name__ == "__main__":
    main()
