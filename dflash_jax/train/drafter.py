"""Train a DFlash drafter for a frozen target, by the DFlash recipe (arXiv 2602.06036 section 3; SpecForge
`specforge/core/dflash.py` after its fix PR #473, since z-lab has released no training code).

The data is the target's own continuations of corpus prompts (`drafter_data`), so the drafter learns what *this*
target says; the loss is a decay-weighted cross-entropy over many anchored blocks per sequence (`drafter_loss`).
The target, its embedding and its LM head stay frozen: only fc, hidden_norm, the layers and norm train. This module
is the run itself: the shared flags, warm starts, the held-out tau evaluation, the saved drafter and its report.

The command itself (`dflash-jax train-drafter`: its flags, data, resume and mesh) is `train.drafter_run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.decode.programs import generate
from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.orbax_folder import save
from dflash_jax.io.shipped import smollm2_path
from dflash_jax.models.drafter import Drafter, init_drafter
from dflash_jax.models.target import Target
from dflash_jax.params import abstract_drafter, from_named, named_leaves
from dflash_jax.train import corpus
from dflash_jax.train.drafter_data import chat_prompt_ids, make_batch_fn
from dflash_jax.train.loop import OptimConfig, run
from dflash_jax.train.repetition import seq_rep_n

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def shipped_drafter_config(target_cfg: TargetConfig, mask_token_id: int, *, layers: int = 1, block_size: int = 16,
                           taps: int = 3, tap_ids=None) -> DrafterConfig:
    model = target_cfg.drafter_stack(layers)  # Qwen3 layers, whatever the target's family
    ids = tuple(tap_ids) if tap_ids else default_target_layer_ids(target_cfg.num_hidden_layers, taps)
    return DrafterConfig(model=model, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                         num_target_layers=target_cfg.num_hidden_layers)


def measure_tau(target: Target, drafter: Drafter, prompts: list[list[int]], *, max_new_tokens: int = 128,
                draft_length: int | None = None, eos_ids=()) -> dict:
    # eos_ids () by default: tau over whole budgets, as measured before EOS became the default (an instruct
    # target's answers end at its EOS); float32 products: the drafter's measure is the same function on every CPU
    # (generation's default takes bfloat16 ones where the CPU has AVX512-BF16)
    res = generate(target, drafter, prompts, max_new_tokens=max_new_tokens, draft_length=draft_length,
                   eos_ids=eos_ids, bf16_products=False)
    # seq-rep-4 of the (greedy) answers themselves: whether the target loops on these prompts, which inflates tau
    reps = [seq_rep_n(t, 4) for t in res.token_lists()]
    return {"tau": res.tau, "acceptance_rate": res.acceptance_rate,
            "seq_rep4_median": round(float(statistics.median(reps)), 4) if reps else None,
            "position_acceptance": [round(float(x), 4) for x in res.position_acceptance]}


def warm_start(cfg: DrafterConfig, fresh, source: Drafter, *, exact: bool = False, grow: bool = False):
    """`fresh` params with every tensor of the `source` drafter copied in (a DFlash drafter into a DFlash2 one
    fills the layers they share). exact: `source` must have every tensor `fresh` has (a warm start of the same
    kind). grow: `source` may have fewer layers than `fresh`; its layers fill the bottom of the stack and each added
    layer on top starts as the identity (its o_proj and down_proj zero, so both residual branches add nothing), so
    the grown drafter starts as exactly `source`'s function and training only adds to it. A tensor that does not
    fit is named."""
    named = dict(named_leaves(fresh))
    theirs = named_leaves(source.params)
    for name, leaf in theirs.items():
        if name not in named or tuple(named[name].shape) != tuple(leaf.shape):
            raise ValueError(f"--init-from: tensor {name} {tuple(leaf.shape)} does not fit this "
                             f"{cfg.kind} drafter")
        named[name] = jnp.asarray(leaf, named[name].dtype)
    covered = set(theirs)  # the tensors whose start is decided: copied, or an added layer's
    if grow:
        have, want = source.config.model.num_hidden_layers, cfg.model.num_hidden_layers
        if have >= want:
            raise ValueError(f"--grow: the --init-from drafter has {have} layers, not fewer than --layers {want}")
        added = [name for name in named if name.startswith("layers.") and int(name.split(".")[1]) >= have]
        for name in added:
            if name.endswith(("self_attn.o_proj", "mlp.down_proj")):
                named[name] = jnp.zeros_like(named[name])
        covered |= set(added)
    if exact and covered != set(named):
        raise ValueError(f"--init-from: the drafter lacks {sorted(set(named) - covered)[:4]} "
                         f"(it is not a {cfg.kind} drafter of this layout{'' if grow else '; --grow adds layers'})")
    return from_named(abstract_drafter(cfg), named)


def replayed_batches_warning(init_from, data_dir, seed: int) -> str | None:
    """A warning when a warm start (`--init-from`) reads datagen shards its source drafter was trained on with the same
    --seed: the shard stream's order depends on the seed only, so the new run's first batches are exactly the source
    run's (in the 2026-12-05 2-layer run, 300 steps re-read the 391k answer tokens its source had read, and held-out
    tau dipped meanwhile). None when the source has no training report, was trained on other data or another seed."""
    path = Path(init_from) / "train_report.json"
    if data_dir is None or not path.exists():
        return None
    report = json.loads(path.read_text())
    seed_was = report.get("seed")
    if seed_was is None:  # reports before "seed" was recorded: their command line, else the --seed default of 0
        words = str(report.get("command", "")).split()
        seed_was = int(words[words.index("--seed") + 1]) if "--seed" in words[:-1] else 0
    if not report.get("data") or Path(report["data"]).resolve() != Path(data_dir).resolve() or seed_was != seed:
        return None
    seen = report.get("answer_tokens_seen")
    what = f"the {seen:,} answer tokens it read" if isinstance(seen, int) else "what it read"
    return (f"warning: --init-from {init_from} was trained on {data_dir} with --seed {seed}: this run's batches start "
            f"as that run's did, re-reading {what}; give another --seed to read other answers first")


def init_from_target(cfg: DrafterConfig, fresh, target: Target):
    """`fresh` drafter params started from the target's own layers: drafter layer j = target layer t+1+j (t = the
    deepest tap, so the layers that turn that feature into the target's prediction; the last ones when fewer are
    left), q/k norms at 1 (the target has none), fc picking the deepest tap alone, hidden_norm = the first copied
    layer's input norm (so the context keys / values start as that layer's own), norm = the target's final norm."""
    p = target.params
    top, H = max(cfg.target_layer_ids), cfg.model.hidden_size
    n = target.config.num_hidden_layers
    first = min(top + 1, n - cfg.model.num_hidden_layers)
    src = p.layers[first:first + cfg.model.num_hidden_layers]
    i = list(cfg.target_layer_ids).index(top)
    fc = np.zeros(fresh.fc.shape, np.float32)
    fc[:, i * H:(i + 1) * H] = np.eye(H, dtype=np.float32)
    cast = (lambda x, like: jnp.asarray(x, like.dtype))
    rep = dataclasses.replace
    layers = tuple(
        rep(mine, input_layernorm=cast(theirs.input_layernorm, mine.input_layernorm),
            post_attention_layernorm=cast(theirs.post_attention_layernorm, mine.post_attention_layernorm),
            self_attn=rep(mine.self_attn, **{k: cast(getattr(theirs.self_attn, k), getattr(mine.self_attn, k))
                                             for k in ("q_proj", "k_proj", "v_proj", "o_proj")}),
            mlp=jax.tree.map(cast, theirs.mlp, mine.mlp))
        for mine, theirs in zip(fresh.layers, src))
    return rep(fresh, fc=cast(fc, fresh.fc), hidden_norm=cast(src[0].input_layernorm, fresh.hidden_norm),
               layers=layers, norm=cast(p.norm, fresh.norm))


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
    if not args.eval_prompts:
        prompts = []
    elif args.chat:
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
