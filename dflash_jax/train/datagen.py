"""Generate drafter training data into a work dir: the target's answers to a prompt queue, with the tapped features
of every position, from the refilling batch (`train.refill`), written as shards (`train.shards`). Resumable: a rerun
on the same work dir does the queue's prompts that no complete shard holds, in queue order.

    python -m dflash_jax.train.datagen --work-dir /work/data/smollm2_answers          # SmolLM2, the shipped recipe
    python -m dflash_jax.train.datagen_bench --prompts 128                             # old path vs this one

The recipe is the shipped SmolLM2 drafter's (checkpoints/README.md): `chat_prompt_ids` requests of the train split
(at most 96 prompt tokens), answers until `<|im_end|>` or 256 tokens, 25% of the prompts sampled at T 0.7 (by queue
index: prompt i is sampled when floor((i+1) f) > floor(i f)), taps = the shipped drafter's target_layer_ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import jax

from dflash_jax.io.shipped import load_default
from dflash_jax.train import corpus, instructions, shards
from dflash_jax.train.drafter_data import chat_prompt_ids, target_fingerprint
from dflash_jax.train.prompt_sources import package_chat_ids
from dflash_jax.train.refill import Job, RefillSettings, RefillStats, generate_answers, prompt_keys
from dflash_jax.train.shards import DataError, DataSpec


def vocabulary_fingerprint(tok) -> str:
    """sha256 (16 hex digits) of the tokenizer's token -> id table."""
    hf = getattr(tok, "hf", tok)
    items = sorted(hf.get_vocab(with_added_tokens=True).items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def temperature_of(index: int, fraction: float, temperature: float) -> float:
    """Queue index -> its temperature: a `fraction` of any run of consecutive indices is sampled (0 = greedy)."""
    return temperature if math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9) else 0.0


def chat_capacity(split: str) -> int:
    """How many distinct requests `instructions.instruction_requests` can make for `split`: every usable function
    of the split plus the general requests (at its 25% general share)."""
    train, held = corpus.split_files(corpus.stdlib_files())
    files = train if split == "train" else [f for f in held if not corpus.relpath(f).startswith("encodings/")]
    n_code = len(instructions.function_requests(corpus.read_texts(files)))
    n_general = len(instructions.general_requests(split))
    return n_code + min(n_general, n_code // 3)  # round(n * 0.25) general ones must not exceed the templates


def chat_queue(tok, n: int | None, *, split: str, seed: int, max_prompt_tokens: int) -> list[tuple[int, ...]]:
    """`chat_prompt_ids` prompts (n None: as many as the split yields), as tuples."""
    if n is None:
        n = chat_capacity(split)
        ids = instructions.chat_prompts(tok, instructions.instruction_requests(n, split=split, seed=seed))
        return [tuple(p) for p in ids if len(p) <= max_prompt_tokens]
    return [tuple(p) for p in chat_prompt_ids(tok, n, split=split, seed=seed, max_prompt_tokens=max_prompt_tokens)]


def open_work(work: Path, spec: DataSpec, source: dict, prompts: list[tuple[int, ...]], log=print
              ) -> tuple[dict, list[tuple[int, ...]], set[int], int]:
    """Creates or reopens a work dir for `spec`: (manifest, queue, done indices, next shard number).

    The prompts of `source` that the queue lacks are appended to it (a source named before adds only what is new);
    half-written shards of a killed run are discarded; every complete shard is checked."""
    work = Path(work)
    if (work / shards.MANIFEST).exists():
        manifest = shards.read_manifest(work)
        shards.check_spec(DataSpec.from_json(manifest["spec"]), spec, work)
        queue = shards.read_queue(work)
    else:
        work.mkdir(parents=True, exist_ok=True)
        manifest = {"spec": spec.as_json(), "sources": [], "runs": [], "totals": {}}
        queue = []
    for name in shards.discard_partial(work):
        log(f"discarded the unfinished shard {name} (its prompts are done again)")
    long = [i for i, p in enumerate(prompts) if not 1 <= len(p) <= spec.max_prompt_tokens]
    if long:
        raise DataError(f"source {source}: prompt {long[0]} has {len(prompts[long[0]])} tokens, outside "
                        f"1..{spec.max_prompt_tokens}")
    done, next_shard = shards.done_indices(work, spec)  # every shard checked before anything is written
    known = set(queue)
    new = [p for p in dict.fromkeys(prompts) if p not in known]
    if new or not any(s["source"] == source for s in manifest["sources"]):
        manifest["sources"].append({"source": source, "start": len(queue), "count": len(new),
                                    "duplicates_skipped": len(prompts) - len(new)})
        queue = queue + new
        shards.write_queue(work, queue)
    shards.write_manifest(work, manifest)
    return manifest, queue, done, next_shard


def _jobs(queue, todo: list[int], spec: DataSpec, stop: dict) -> Iterator[Job]:
    for start in range(0, len(todo), 1024):
        chunk = todo[start:start + 1024]
        keys = prompt_keys(spec.seed, chunk)
        for i, k in zip(chunk, keys):
            if stop["now"]:
                return
            yield Job(i, queue[i], temperature_of(i, spec.sampled_fraction, spec.temperature), k)


def _totals(work: Path) -> dict:
    metas = [json.loads((p / "meta.json").read_text()) for p in shards.shard_dirs(work)]
    return {"shards": len(metas), "answers": sum(m["answers"] for m in metas),
            "tokens": sum(m["tokens"] for m in metas), "answer_tokens": sum(m["answer_tokens"] for m in metas),
            "feature_bytes": sum(m["bytes"]["features"] for m in metas)}


def run(target, work: Path, spec: DataSpec, settings: RefillSettings, *, source: dict, prompts,
        limit: int | None = None, max_answer_tokens: int | None = None, shard_answers: int = 256, command: str = "",
        log=print) -> dict:
    """Generates answers for the queue's undone prompts (at most `limit` answers in this run; none once the work dir
    holds `max_answer_tokens` answer tokens) into `work`. Returns this run's record (also in the manifest).
    SIGTERM / SIGINT stop taking new prompts: the rows in flight finish and are written."""
    # what the data is comes from the spec; `settings` only says how the batch runs
    settings = settings.replace(layer_ids=spec.layer_ids, eos_ids=spec.eos_ids, max_new_tokens=spec.max_new_tokens,
                                max_prompt_tokens=spec.max_prompt_tokens, feature_dtype=spec.feature_dtype)
    manifest, queue, done, number = open_work(work, spec, source, prompts, log)
    totals = _totals(work)
    todo = [i for i in range(len(queue)) if i not in done]
    if limit is not None:
        todo = todo[:limit]
    record = {"started": time.strftime("%FT%T"), "command": command, "rows": settings.rows, "steps": settings.steps,
              "refill_min": settings.refill_min, "queue": len(queue), "done_before": len(done),
              "todo": len(todo), "answers": 0, "answer_tokens": 0, "tokens": 0, "seconds": 0.0}
    manifest["runs"].append(record)
    log(f"{work}: queue {len(queue)} prompts, {len(done)} done, {len(todo)} to do in this run; "
        f"{totals['answer_tokens']:,} answer tokens so far")
    stop = {"now": max_answer_tokens is not None and totals["answer_tokens"] >= max_answer_tokens}
    old = {s: signal.signal(s, lambda *_: stop.update(now=True)) for s in (signal.SIGTERM, signal.SIGINT)}
    stats, buf, t0 = RefillStats(), [], time.perf_counter()
    have = totals["answer_tokens"]
    try:
        def flush():
            nonlocal number
            meta = shards.write_shard(work, number, buf, spec)
            number += 1
            buf.clear()
            secs = time.perf_counter() - t0
            record.update(answers=stats.answers, answer_tokens=stats.answer_tokens, seconds=round(secs, 1),
                          answer_tokens_per_s=round(stats.answer_tokens / secs, 2),
                          live_row_share=round(stats.live_row_steps / max(stats.row_steps, 1), 4),
                          decode_calls=stats.decode_calls, refill_calls=stats.refill_calls)
            manifest["totals"] = _totals(work)
            shards.write_manifest(work, manifest)
            log(f"shard {number - 1:05d}: {meta['answers']} answers, {meta['answer_tokens']:,} answer tokens; run: "
                f"{stats.answers} answers, {stats.answer_tokens:,} tokens in {secs:.0f} s = "
                f"{stats.answer_tokens / secs:.1f} answer tokens/s (live rows {record['live_row_share']:.1%}); "
                f"work dir: {manifest['totals']['answer_tokens']:,} answer tokens")

        for ans in generate_answers(target, _jobs(queue, todo, spec, stop), settings, stats):
            buf.append(ans)
            record["tokens"] += len(ans.tokens)
            have += len(ans.tokens) - ans.prompt_len
            if max_answer_tokens is not None and have >= max_answer_tokens:
                stop["now"] = True
            if len(buf) >= shard_answers:
                flush()
        if buf:
            flush()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    record["finished"] = time.strftime("%FT%T")
    shards.write_manifest(work, manifest)
    log(f"done: {stats.answers} answers, {stats.answer_tokens:,} answer tokens in {record['seconds']} s")
    return record


def spec_for(target, tok, *, layer_ids, block_size: int, max_prompt_tokens: int, max_new_tokens: int,
             sampled_fraction: float, temperature: float, seed: int) -> DataSpec:
    return DataSpec(target_fingerprint=target_fingerprint(target), layer_ids=tuple(int(i) for i in layer_ids),
                    hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                    vocabulary=vocabulary_fingerprint(tok), block_size=int(block_size),
                    max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, eos_ids=(int(tok.eos_id),),
                    sampled_fraction=float(sampled_fraction), temperature=float(temperature), seed=int(seed))


def add_recipe_arguments(ap) -> None:
    ap.add_argument("--model", default="smollm2", help="the shipped pair (`load_default`): target, taps, tokenizer")
    ap.add_argument("--taps", type=int, nargs="+", default=None, help="tap layer ids (default: the shipped drafter's)")
    ap.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the shipped one's)")
    ap.add_argument("--split", default="train", choices=("train", "eval"), help="prompt source split")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the chat_prompt_ids draw")
    ap.add_argument("--max-prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=256, help="answer budget per prompt")
    ap.add_argument("--sampled-fraction", type=float, default=0.25)
    ap.add_argument("--sample-temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i: fold_in(key(seed), i))")
    ap.add_argument("--rows", type=int, default=64, help="rows decoding together")
    ap.add_argument("--steps", type=int, default=32, help="K: decode steps per program call at most")
    ap.add_argument("--refill-min", type=int, default=4, help="a decode call returns once this many rows finished")


def settings_for(spec: DataSpec, args) -> RefillSettings:
    return RefillSettings(layer_ids=spec.layer_ids, eos_ids=spec.eos_ids, max_new_tokens=spec.max_new_tokens,
                          max_prompt_tokens=spec.max_prompt_tokens, rows=args.rows, steps=args.steps,
                          refill_min=args.refill_min, feature_dtype=spec.feature_dtype)


def load_pair(args):
    """(target float32, shipped drafter, tokenizer) of --model."""
    return load_default(model=args.model, compute_dtype="float32")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.train.datagen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", required=True, help="shards, manifest, queue (rerun to resume or extend)")
    ap.add_argument("--source", choices=("chat", "packages"), default="chat",
                    help="chat: chat_prompt_ids requests (stdlib functions + general requests); packages: the same "
                         "coding templates over the installed corpus packages' train-split functions "
                         "(`train.prompt_sources`), appended to the queue after what it holds")
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts of the chat source (default: every distinct one the split yields)")
    ap.add_argument("--limit", type=int, default=None, help="answers in this run at most")
    ap.add_argument("--max-answer-tokens", type=int, default=2_000_000,
                    help="stop taking prompts once the work dir holds this many answer tokens")
    ap.add_argument("--shard-answers", type=int, default=256, help="answers per shard")
    add_recipe_arguments(ap)
    args = ap.parse_args(argv)
    # JAX's persistent compilation cache in the work dir: a resumed run loads its programs instead of compiling them
    jax.config.update("jax_compilation_cache_dir", str(Path(args.work_dir) / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    target, drafter, tok = load_pair(args)
    spec = spec_for(target, tok, layer_ids=args.taps or drafter.config.target_layer_ids,
                    block_size=args.block_size or drafter.config.block_size,
                    max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.new_tokens,
                    sampled_fraction=args.sampled_fraction, temperature=args.sample_temperature, seed=args.seed)
    if args.source == "packages":
        prompts, source = package_chat_ids(tok, seed=args.prompt_seed, max_prompt_tokens=args.max_prompt_tokens)
    else:
        source = {"kind": "chat_prompt_ids", "split": args.split, "seed": args.prompt_seed,
                  "max_prompt_tokens": args.max_prompt_tokens, "n": args.prompts}
        try:
            prompts = chat_queue(tok, args.prompts, split=args.split, seed=args.prompt_seed,
                                 max_prompt_tokens=args.max_prompt_tokens)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    try:
        run(target, Path(args.work_dir), spec, settings_for(spec, args), source=source, prompts=prompts,
            limit=args.limit, max_answer_tokens=args.max_answer_tokens, shard_answers=args.shard_answers,
            command="python -m dflash_jax.train.datagen " + " ".join(argv), log=lambda m: print(m, flush=True))
    except DataError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
