"""The shared training loop: AdamW + warmup/cosine + clipping, orbax checkpoints, resume, progress with ETA.

Batches are a pure function of the step number (`batch_fn(step)`), so a resumed run sees exactly the batches the
interrupted one would have seen; a batch that depends on the model itself (its own generations, as in unlikelihood
fine-tuning) is `batch_fn(step, params)` with `batch_uses_params=True`, a pure function of the step and the restored
weights.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dflash_jax.io.tokenizer import Tokenizer, load_tokenizer
from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.parallel.sharding import place


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    steps: int
    lr: float = 1e-3
    warmup_ratio: float = 0.04
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b2: float = 0.95
    clip_norm: float = 1.0


def make_optimizer(cfg: OptimConfig, trainable_mask: Any = None) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.steps * cfg.warmup_ratio))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  end_value=cfg.lr * cfg.final_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=trainable_mask))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a data-parallel run keeps its arrays: parameters (and so the optimizer state) with `params` (a tree of
    NamedShardings: replicated, or split by the logical-axis rules); `batch(host batch)` places a batch (its data
    along the mesh's "data" axis). With several processes every process passes the same host values and each
    builds only its own devices' shards (`parallel.sharding.place`)."""

    params: Any
    batch: Callable[[Any], Any]


def _clock_of(restored) -> np.ndarray:
    return np.asarray(restored.get("clock", np.zeros(2)), np.float64)


def run(*, params, loss_fn: Callable, batch_fn: Callable[[int], Any], optim: OptimConfig, ckpt_dir: str | Path,
        eval_fn: Callable[[Any], dict] | None = None, eval_every: int = 0, ckpt_every: int = 200,
        desc: str = "train", log_file: str | Path | None = None, batch_uses_params: bool = False,
        stop_at: int | None = None, placement: Placement | None = None,
        on_start: Callable[[int], None] | None = None) -> tuple[Any, list[dict]]:
    """Minimise loss_fn(params, batch) -> (loss, metrics dict); resumes from the newest checkpoint in ckpt_dir.

    A checkpoint holds the params, the optimizer state (Adam moments and the schedule's step count) and the run's
    clock (training CPU and wall seconds so far); the step is its number. With batches a pure function of the step,
    a run stopped anywhere and started again ends bit for bit where an unstopped one does. stop_at: this invocation
    stops (with a checkpoint) once that many steps are done, while the schedule still spans `optim.steps`, so runs
    of any length chain into one schedule. SIGTERM stops it the same way after the step in flight. on_start(step) is
    called with the step the run (re)starts at, before the first batch (a data plan is fixed there). placement: a
    data-parallel run over a mesh (see `Placement`); log and progress come from process 0 alone."""
    import orbax.checkpoint as ocp

    tx = make_optimizer(optim)
    if placement is not None:
        params = jax.tree.map(_place, params, placement.params)
        opt_state = jax.jit(tx.init)(params)  # moments placed like their parameters; counts replicated below
        rep = NamedSharding(jax.tree.leaves(placement.params)[0].mesh, P())
        opt_state = jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else _place(x, rep), opt_state)
    else:
        opt_state = tx.init(params)
    ckpt_dir = Path(ckpt_dir).absolute()
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start, clock = 0, np.zeros(2)  # clock: training CPU seconds (this process), wall seconds
    if manager.latest_step() is not None:
        start = manager.latest_step()
        try:
            restored = manager.restore(start, args=ocp.args.StandardRestore(
                {"params": params, "opt": opt_state, "clock": clock}))
        except (ValueError, KeyError):  # a checkpoint written before the clock was kept
            restored = manager.restore(start, args=ocp.args.StandardRestore({"params": params, "opt": opt_state}))
        params, opt_state, clock = restored["params"], restored["opt"], _clock_of(restored)
        _print(f"[{desc}] resumed from step {start} in {ckpt_dir}")
    if on_start is not None:
        on_start(start)
    end = optim.steps if stop_at is None else min(int(stop_at), optim.steps)

    def step_fn(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    if placement is None:
        step_fn = jax.jit(step_fn)
    else:  # the update keeps every array where it was (XLA adds the gradient all-reduce over "data")
        shardings = (placement.params, jax.tree.map(lambda x: x.sharding, opt_state))
        step_fn = jax.jit(step_fn, out_shardings=shardings + (None,))

    history: list[dict] = []
    lead = jax.process_index() == 0
    log = open(log_file, "a") if log_file and lead else None
    bar = tqdm(range(start, end), initial=start, total=optim.steps, desc=desc, mininterval=5.0, disable=not lead)
    stop = {"now": False}
    old = _on_sigterm(stop)
    t0, cpu0, running = time.perf_counter(), time.process_time() - clock[0], None
    wall0 = t0 - clock[1]
    try:
        for step in bar:
            batch = batch_fn(step, params) if batch_uses_params else batch_fn(step)
            if placement is not None:
                batch = placement.batch(batch)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            if step % 10 == 0 or step + 1 == end:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                running = m["loss"] if running is None else 0.9 * running + 0.1 * m["loss"]
                bar.set_postfix(loss=f"{running:.3f}")
                rec = {"step": step, "elapsed_s": round(time.perf_counter() - t0, 1),
                       "cpu_s": round(time.process_time() - cpu0, 1), "wall_s": round(time.perf_counter() - wall0, 1),
                       **m}
                if eval_fn is not None and eval_every and (step % eval_every == 0 or step == optim.steps - 1) and step:
                    e0 = time.process_time()
                    rec.update(eval_fn(params))
                    cpu0 += time.process_time() - e0  # the run's clock counts training, not evaluation
                    if lead:
                        tqdm.write(f"[{desc}] step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in rec.items()
                                                                         if isinstance(v, float)))
                history.append(rec)
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
            last = step + 1 == end or stop["now"]
            if (step + 1) % ckpt_every == 0 or step == optim.steps - 1 or last:
                clock = np.asarray([time.process_time() - cpu0, time.perf_counter() - wall0])
                manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state,
                                                                    "clock": clock}))
            if stop["now"]:
                _print(f"[{desc}] stopped by SIGTERM after step {step + 1} (checkpoint saved)")
                break
    finally:
        # Saves are asynchronous: an interruption (exception, Ctrl-C) must not lose the last checkpoint in flight,
        # or the next run resumes from an older one.
        manager.wait_until_finished()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        if log:
            log.close()
    return params, history


def _print(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def _on_sigterm(stop: dict):
    """SIGTERM ends the run after the step in flight, with a checkpoint (main thread only; else left as it is)."""
    try:
        return signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    except ValueError:
        return None


def _place(x, sharding):
    return place(x, sharding)


def batch_rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position CE [..] in f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def load_training_tokenizer(path):
    """The tokenizer a trainer needs (EOS, and for the shipped models the drafter's mask token), or an error that
    says what to do. A GGUF file (a pretrained model's own tokenizer) is read with `load_tokenizer`."""
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise SystemExit(f"error: no tokenizer at {path}: pass --tokenizer, or train one with "
                         "`python -m dflash_jax.train.tokenizer_train --out {path}`")
    if path.suffix == ".gguf":
        try:
            return load_tokenizer(path)
        except Exception as e:
            raise SystemExit(f"error: {path}: {e}") from None
    try:
        return Tokenizer.from_file(path)
    except ValueError as e:  # lacks <|endoftext|> / <|mask|>
        raise SystemExit(f"error: {path}: {e}; train a tokenizer with them "
                         "(python -m dflash_jax.train.tokenizer_train)") from None
    except Exception as e:  # not a tokenizer file at all
        raise SystemExit(f"error: {path} is not a tokenizers JSON file ({e})") from None


def lm_loss(cfg):
    """loss_fn(params, tokens [B, S+1]) -> (mean next-token cross-entropy of a target of config cfg, {})."""
    def loss_fn(params, batch):
        tokens = batch  # [B, S+1]
        logits, _, _ = forward_with_cache(Target(params=params, config=cfg), tokens[:, :-1], None)
        ce = cross_entropy(logits, tokens[:, 1:])
        return ce.mean(), {}
    return loss_fn
