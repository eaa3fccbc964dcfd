"""The `dflash-jax` command. Every subcommand defaults to the embedded models in `checkpoints/`.

    dflash-jax generate "def fibonacci(n):"     text, then tau and tokens/s for DFlash vs autoregressive
    dflash-jax generate --no-compare "..."       the text and tau only (no autoregressive run)
    dflash-jax bench                             128/512/1024 new tokens on held-out prompts (medians)
    dflash-jax bench --nvfp4                     the same with NVFP4 drafters (with and without scales), and
                                                 DFlash2 rows (dense / NVFP4 / scales dropped) when one exists
    dflash-jax bench --random-tiny               ms per step split into draft/verify/bookkeeping, r and c
    dflash-jax bench --device-report --out DIR   the prepared GPU run: NVFP4 backends, step costs (--smoke: CPU)
    dflash-jax train-target / train-drafter      reproduce the shipped checkpoints (resumable)
    dflash-jax train-drafter --kind dflash2      train the DFlash2 drafter (checkpoints/drafter2, resumable)
    dflash-jax audit PATH                        NVFP4 scale audit of a GGUF drafter, HF/ModelOpt or saved folder

Compiled programs are kept in JAX's persistent compilation cache (`dflash_jax.io.compile_cache`: under
$XDG_CACHE_HOME/dflash-jax, or ~/.cache/dflash-jax), so a second run skips compiling; DFLASH_JAX_NO_COMPILE_CACHE=1
turns it off.
"""

from __future__ import annotations

import argparse
import sys


def _generate(args):
    from dflash_jax import generate, generate_autoregressive
    from dflash_jax.io.shipped import load_default

    try:
        target, drafter, tok = load_default(model=args.model, drafter=args.kind)
    except FileNotFoundError as e:  # e.g. the model package is not installed: the message says how to install it
        raise SystemExit(f"error: {e}") from None
    if args.draft_vocab is not None:
        drafter = _with_draft_vocab(drafter, args.draft_vocab)
    if args.nvfp4:
        from dflash_jax.quant.quantize import quantize_nvfp4
        drafter = quantize_nvfp4(drafter)
    if not args.prompt.strip():
        raise SystemExit("error: the prompt is empty")
    # An instruct model gets the request as one user turn through its own chat template; --raw continues the text.
    chat = bool(getattr(tok, "chat_template", None)) and not args.raw
    ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True) if chat
           else tok.encode(args.prompt))
    if not ids:
        raise SystemExit("error: the prompt encodes to no tokens")
    limit = target.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > limit:
        raise SystemExit(f"error: the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens} exceeds "
                         f"the model's context of {limit} tokens")

    def show(tokens) -> str:
        if chat:
            return f"user: {args.prompt}\nassistant: {tok.decode(tokens, skip_special=True)}"
        return args.prompt + tok.decode(tokens)
    # prefill timed by a rerun rather than a host callback: programs with callbacks never enter the compile cache
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_ids=(tok.eos_id,),
              seed=args.seed, prefill_timing="rerun")
    if args.no_compare:  # the text alone: one speculative run, nothing timed
        sp = generate(target, drafter, [ids], draft_length=args.draft_length, **kw)
        print(show(sp.token_lists()[0]))
        print("-" * 72)
        print(f"{int(sp.num_tokens[0])} tokens in {sp.num_steps} steps: tau {sp.tau:.2f} (tokens per draft+verify "
              f"step, incl. bonus), acceptance rate {100 * sp.acceptance_rate:.1f}% of {sp.draft_length} drafted")
        return
    # Each program runs once before it is timed: a first execution pays one-time costs (allocations, thread pools).
    for _ in range(2):
        ar = generate_autoregressive(target, [ids], **kw)
        sp = generate(target, drafter, [ids], draft_length=args.draft_length, **kw)
    print(show(sp.token_lists()[0]))
    print("-" * 72)
    same = "identical to" if sp.token_lists() == ar.token_lists() else "differs from (sampling)"
    print(f"{'DFlash2' if args.kind == 'dflash2' else 'DFlash'} output {same} autoregressive output; "
          f"{int(sp.num_tokens[0])} tokens, {sp.num_steps} steps")
    print(f"tau {sp.tau:.2f} (tokens per draft+verify step, incl. bonus), acceptance rate "
          f"{100 * sp.acceptance_rate:.1f}% of {sp.draft_length} drafted per step")
    print(f"decode tokens/s: DFlash {sp.decode_tokens_per_second:.1f} vs autoregressive "
          f"{ar.decode_tokens_per_second:.1f} -> {sp.decode_tokens_per_second / ar.decode_tokens_per_second:.2f}x"
          f"  (prefill {1e3 * sp.timings['prefill_s']:.1f} ms; compile and first run excluded)")


def _bench(args):
    if args.bf16_exactness:
        return _bf16_exactness(args)
    args.prompts = 8 if args.prompts is None else args.prompts
    args.new_tokens = [128, 512, 1024] if args.new_tokens is None else args.new_tokens
    if args.device_report:
        from dflash_jax.bench import device_report
        return device_report.main((["--smoke"] if args.smoke else []) + (["--out", args.out] if args.out else []))
    import jax
    import numpy as np  # noqa: F401

    from dflash_jax.bench import speculative as bench

    if args.random_tiny:
        from dflash_jax.config import DrafterConfig, TargetConfig
        from dflash_jax.models.drafter import init_drafter
        from dflash_jax.decode.programs import generate
        from dflash_jax.models.target import init_target
        cfg = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        dcfg = DrafterConfig(model=cfg.replace(num_hidden_layers=2), block_size=16, mask_token_id=511,
                             target_layer_ids=(1, 2, 3), num_target_layers=6)
        target, drafter = init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))
        print(f"random tiny models: target {cfg.num_hidden_layers} layers H={cfg.hidden_size} V={cfg.vocab_size}; "
              f"drafter {dcfg.model.num_hidden_layers} layers, block {dcfg.block_size}")
        prompt = [list(np.random.default_rng(0).integers(0, 511, 64))]
        for D in (args.draft_length or 7, 15):
            kw = dict(max_new_tokens=256, draft_length=D, prefill_timing="rerun")
            res = generate(target, drafter, prompt, **kw)
            res = generate(target, drafter, prompt, **kw)
            step_ms = 1e3 * res.timings["decode_s"] / max(res.num_steps, 1)
            costs = bench.step_costs(target, drafter, context_len=64 + 128, draft_length=D)
            print(bench.format_step_costs(costs, tau=res.tau, measured_step_ms=step_ms))
            print()
        return

    from dflash_jax.io.shipped import load_default

    target, drafter, tok = load_default(model=args.model)
    prompts = _heldout_prompts(tok, args.prompts, args.seed)
    if args.draft_vocab is not None:
        drafter = _with_draft_vocab(drafter, args.draft_vocab)
    if args.step_table:
        from dflash_jax.bench import tree as tree_bench
        lengths = (args.draft_length,) if args.draft_length else (1, 3, 7)
        rows = bench.step_table(target, drafter, prompts, draft_lengths=lengths, max_new_tokens=args.new_tokens[0],
                                reps=args.reps)
        rows += tree_bench.tree_rows(target, drafter, prompts, budgets=tuple(args.tree_budgets),
                                     max_new_tokens=args.new_tokens[0], reps=args.reps)
        print(f"{len(prompts)} held-out prompts, {args.new_tokens[0]} new tokens, greedy, batch 1, one run")
        print(bench.format_step_table(rows))
        vocab = rows[-1]["draft_vocab"] if rows else None  # the tree rows' vocabulary: compare like with like
        print(tree_bench.format_tree_goals([r for r in rows if r["draft_vocab"] == vocab]))
        return
    if args.tau_table:
        _tau_table(args, target, drafter, tok, prompts)
        return
    if args.pair_table:
        _pair_table(args, target, drafter, prompts)
        return
    if args.gguf_roundtrip:
        _gguf_roundtrip(args, target, drafter, prompts)
        return
    extra, names, names2 = {}, ["dflash"], []
    dflash2 = None
    if args.nvfp4:
        from dflash_jax.quant.quantize import ATTENTION_PROJECTIONS, DFLASH2_PROJECTIONS, drop_global_scales, quantize_nvfp4
        q = quantize_nvfp4(drafter)
        extra = {"nvfp4 no-scale": drop_global_scales(q), "nvfp4": q}
        names += list(extra)
        dflash2 = _dflash2_drafter(args)
        if dflash2 is not None:
            q2 = quantize_nvfp4(dflash2)
            # "no-scale": the report's bug (attention scales dropped); "no conv/sel scale": only DFlash2's own
            # projections without their tensor scales (llama.cpp still runs those unscaled: its PR #28000 scaled
            # only the attention projections)
            rows2 = {"dflash2": dflash2, "dflash2 nvfp4": q2,
                     "dflash2 nvfp4 no-scale": drop_global_scales(q2, ATTENTION_PROJECTIONS),
                     "dflash2 nvfp4 no conv/sel scale": drop_global_scales(q2, DFLASH2_PROJECTIONS)}
            extra.update(rows2)
            names2 = list(rows2)
    print(f"embedded models, {len(prompts)} held-out stdlib prompts, batch 1, greedy, draft length "
          f"{args.draft_length or drafter.config.block_size - 1} (block {drafter.config.block_size}); "
          f"decode tokens/s exclude prefill and compile; medians over prompts; one run")
    if args.temperature:
        print(f"temperature {args.temperature}: rejection sampling; 'exact' compares with one AR sample (not expected "
              "to match)")
    results = []
    for n in args.new_tokens:
        results.append(bench.compare(target, drafter, prompts, max_new_tokens=n, draft_length=args.draft_length,
                                     drafters=extra, temperature=args.temperature, seed=args.seed))
    print(bench.format_compare_table(results, names))
    if names2:
        print()
        print("DFlash2 drafter (same prompts, same run):")
        print(bench.format_compare_table(results, names2))
    costs = bench.step_costs(target, drafter, context_len=256, draft_length=args.draft_length)
    print()
    print(bench.format_step_costs(costs, tau=results[0]["dflash"]["tau"]))
    print("acceptance rate per block position (first table row): "
          + " ".join(f"{x:.2f}" for x in results[0]["dflash"]["position_acceptance"]))
    if names2:
        print("DFlash2 acceptance rate per block position (first table row): "
              + " ".join(f"{x:.2f}" for x in results[0]["dflash2"]["position_acceptance"]))
        D = args.draft_length or drafter.config.block_size - 1
        dc = bench.draft_costs(target, {"dflash": drafter, "dflash2": dflash2}, context_len=256, draft_length=D,
                               clock="cpu")
        print(bench.format_draft_costs(dc))
        print(bench.format_dflash2_goals(results, dc))


def _heldout_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Held-out prompts for the benches: requests through the chat template for an instruct model (never trained
    on: the held-out split of `train.instructions`), held-out code otherwise."""
    from dflash_jax.train import corpus
    from dflash_jax.train.drafter import chat_prompt_ids

    if getattr(tok, "chat_template", None):
        return chat_prompt_ids(tok, n, split="eval", seed=seed)
    return [tok.encode(t) for t in corpus.held_out_prompts(n, seed=seed)]


def _bf16_exactness(args):
    from dflash_jax.bench import speculative as bench
    from dflash_jax.io.shipped import load_default

    target, drafter, tok = load_default(model=args.model, compute_dtype="bfloat16")
    n = 32 if args.prompts is None else args.prompts
    new = 256 if args.new_tokens is None else args.new_tokens[0]
    prompts = _heldout_prompts(tok, n, args.seed)
    d = bench.bf16_exactness(target, drafter, prompts, max_new_tokens=new, draft_length=args.draft_length)
    print(bench.format_bf16_exactness(d) + f" ({d['wall_s']:.0f} s)")
    return d


def _pair_table(args, target, drafter, prompts):
    from dflash_jax.bench import speculative as bench
    from dflash_jax.quant.quantize import quantize_nvfp4

    lengths = (args.draft_length,) if args.draft_length else (7, 15)
    temps = (args.temperature,) if args.temperature is not None else (0.0, 0.7)
    print(f"embedded pair, {len(prompts)} held-out prompts, batch 1, dense and NVFP4 (RTN) DFlash drafter; decode "
          f"tokens/s exclude prefill and compile; speedup = median drafter tok/s / median AR tok/s, same run; at T > 0 "
          f"rejection sampling (output not expected to equal the AR sample)")
    rows = bench.pair_table(target, {"dense": drafter, "nvfp4": quantize_nvfp4(drafter)}, prompts,
                            new_tokens=args.new_tokens, draft_lengths=lengths, temperatures=temps, seed=args.seed)
    print(bench.format_pair_table(rows, ("dense", "nvfp4")))
    print(bench.format_pair_goals(rows))


def _dflash2_drafter(args):
    """The DFlash2 drafter for the bench: --dflash2 PATH, else the one shipped for the bench's model (code-5m:
    checkpoints/drafter2, smollm2: checkpoints/smollm2/drafter2), else None (with a note). Never another model's:
    a drafter reads its own target's hidden states."""
    from dflash_jax.io.gguf_drafter import load_drafter  # folders and GGUF drafters
    from dflash_jax.io.shipped import checkpoints_dir, default_model

    model = getattr(args, "model", None) or default_model()
    root = checkpoints_dir() / "smollm2" if model == "smollm2" else checkpoints_dir()
    path = args.dflash2 or root / "drafter2"
    try:
        d = load_drafter(path)
    except FileNotFoundError:
        print(f"(no DFlash2 drafter at {path}: DFlash2 rows skipped; train one with "
              "`dflash-jax train-drafter --kind dflash2` or pass --dflash2 PATH)")
        return None
    if d.config.kind != "dflash2":
        raise SystemExit(f"error: {path} holds a {d.config.kind} drafter, not a DFlash2 one")
    return d


def _quality(args):
    from dflash_jax.bench import quality
    from dflash_jax.io.checkpoint import load_target
    from dflash_jax.io.shipped import checkpoints_dir
    from dflash_jax.io.tokenizer import Tokenizer

    # Only the tokenizer and the one target measured: no drafter, no second target.
    tok = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    target = load_target(args.target or checkpoints_dir() / "target")
    if args.target and target.config.vocab_size != tok.vocab_size:
        raise SystemExit(f"error: --target {args.target} has vocab {target.config.vocab_size}, the shipped "
                         f"tokenizer {tok.vocab_size}")
    r = quality.report(target, tok, prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                       windows=args.windows)
    print(quality.format_report(r, show=args.show))


def _with_draft_vocab(drafter, n: int):
    """The drafter drafting over the first n token ids (0: the whole vocabulary), a clear error otherwise."""
    V = drafter.config.model.vocab_size
    if not 0 <= n <= V:
        raise SystemExit(f"--draft-vocab {n}: must be 0 (the whole vocabulary) or 1..{V}")
    return drafter.replace(config=drafter.config.replace(draft_vocab_size=n or None))


def _tau_table(args, target, drafter, tok, prompts):
    import jax
    import numpy as np

    from dflash_jax.bench import speculative as bench
    from dflash_jax.params import param_bytes
    from dflash_jax.models.calibrate import calibrate_drafter
    from dflash_jax.quant.quantize import drop_global_scales, quantize_nvfp4
    from dflash_jax.train import corpus

    drafters = {"dense": drafter}
    if args.nvfp4:
        train_text = corpus.read_texts(corpus.split_files(corpus.stdlib_files())[0][:64])
        stream = corpus.token_stream(tok, train_text, tok.eos_id)
        rng = np.random.default_rng(args.seed)
        # 16 calibration windows for the documented 8 prompts; fewer for a smaller run (the tests' tiny one)
        windows = [stream[s:s + 96] for s in rng.integers(0, len(stream) - 96, min(16, 2 * len(prompts)))]
        cal = calibrate_drafter(target, drafter, windows, anchors_per_window=args.calibration_anchors)
        rtn = quantize_nvfp4(drafter)
        drafters.update({"nvfp4 rtn": rtn, "nvfp4 calibrated": quantize_nvfp4(drafter, method="calibrated",
                                                                              calibration=cal),
                         "nvfp4 w4a4": quantize_nvfp4(drafter, activations="w4a4", calibration=cal),
                         "nvfp4 no-scale": drop_global_scales(rtn)})
        dense_bf16 = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(drafter.params))
        print(f"drafter weight bytes: bf16 {dense_bf16:,}; NVFP4 {param_bytes(rtn.params):,} "
              f"({param_bytes(rtn.params) / dense_bf16:.3f} of bf16; norms stay dense)")
    dflash2 = _dflash2_drafter(args)
    if dflash2 is not None:  # the same prompts and draft lengths, dense and NVFP4 (RTN, every projection)
        drafters.update({"dflash2": dflash2, "dflash2 nvfp4": quantize_nvfp4(dflash2)} if args.nvfp4
                        else {"dflash2": dflash2})
    lengths = (args.draft_length,) if args.draft_length else (3, 7, 15)
    rows = bench.tau_table(target, drafters, prompts, draft_lengths=lengths,
                           max_new_tokens=args.new_tokens[0], temperature=args.temperature)
    print(f"{len(prompts)} held-out prompts, {args.new_tokens[0]} new tokens, temperature {args.temperature}")
    print(bench.format_tau_table(rows))


def _gguf_roundtrip(args, target, drafter, prompts):
    import tempfile

    import numpy as np

    from dflash_jax.bench import speculative as bench
    from dflash_jax.decode.programs import generate
    from dflash_jax.quant.quantize import quantize_nvfp4

    from dflash_jax.io.audit_file import audit_file

    drafters, pairs, audits = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, model in (("", drafter), ("dflash2 ", _dflash2_drafter(args))):
            if model is None:
                continue
            q = quantize_nvfp4(model)
            loaded, bug = bench.gguf_roundtrip(q, tmp, name=kind.strip() or "dflash")
            drafters.update({f"{kind}nvfp4": q, f"{kind}nvfp4 gguf": loaded, f"{kind}nvfp4 gguf attn scale=1": bug})
            pairs.append((f"{kind}nvfp4", q, loaded))
            for label, f in (("intact", "gguf"), ("attention .scale = 1", "attn_scale_1.gguf")):
                name = kind.strip() or "dflash"
                path = f"{tmp}/{name}.gguf" if f == "gguf" else f"{tmp}/{name}_{f}"
                report = audit_file(path, graph=False)
                audits.append(f"  {name} nvfp4 GGUF, {label}: {len(report.rows)} per-tensor scales, flagged "
                              f"{len(report.flagged)}: {', '.join(report.flagged_names) or '-'}")
    D = args.draft_length or drafter.config.block_size - 1
    from dflash_jax.io.shipped import default_model
    print(f"embedded pair {args.model or default_model()}, {len(prompts)} held-out prompts (seed {args.seed}), batch "
          f"1, greedy, draft length {D}: NVFP4 drafters (RTN, the ModelOpt recipe) in memory, written with save_gguf "
          "and read back, and the same file with every attention .scale set to 1.0 (what the engine's graph did)")
    (first, d0), *rest = drafters.items()
    results = [bench.compare(target, d0, prompts, max_new_tokens=n, draft_length=D, drafters=dict(rest),
                             temperature=0.0, seed=args.seed) for n in args.new_tokens]
    for r in results:  # compare() names its first drafter "dflash"
        r[first] = r.pop("dflash")
    print(bench.format_compare_table(results, list(drafters)))
    same = {}
    for name, q, loaded in pairs:  # the output itself, token for token (one batched greedy run each)
        kw = dict(max_new_tokens=args.new_tokens[0], draft_length=D)
        a, b = generate(target, q, [list(p) for p in prompts], **kw), generate(target, loaded, [list(p) for p in prompts], **kw)
        same[f"{name} -> GGUF -> {name}"] = bool(np.array_equal(a.tokens, b.tokens))
    print(bench.format_gguf_goals(results, same))
    for kind in ("", "dflash2 "):  # why the acceptance moves as much as it does: the proposals themselves
        if f"{kind}nvfp4 gguf" in drafters:
            d = bench.proposal_agreement(target, drafters[f"{kind}nvfp4 gguf"],
                                         drafters[f"{kind}nvfp4 gguf attn scale=1"], prompts,
                                         new_tokens=min(64, args.new_tokens[0]))
            print(f"  {kind or 'dflash '}nvfp4 GGUF, intact vs attention .scale = 1: "
                  f"{bench.format_proposal_agreement(d)}")
    print("dflash-jax audit on the written files (scale table):")
    print("\n".join(audits))


def _audit(args):
    from dflash_jax.io.audit_file import audit_file

    target = None
    if args.target:
        from dflash_jax.io.checkpoint import load_target
        target = load_target(args.target, param_dtype="float32", compute_dtype="float32")
    kw = {k: v for k, v in (("vocab_size", args.vocab_size), ("num_target_layers", args.num_target_layers)) if v}
    try:
        report = audit_file(args.path, target=target, graph=not args.no_graph, **kw)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1


def main(argv=None):
    from dflash_jax.io.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # the command's default; DFLASH_JAX_NO_COMPILE_CACHE=1 turns it off
    ap = argparse.ArgumentParser(prog="dflash-jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from a prompt with the embedded models")
    g.add_argument("prompt", help="a request to an instruct model (sent through its chat template), or text to "
                                  "continue (code-5m, or --raw)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--draft-length", type=int, default=None,
                   help="tokens drafted per step, 1..block_size-1 (default: block_size-1)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (output identical to autoregressive); > 0 = lossless rejection sampling")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    g.add_argument("--nvfp4", action="store_true", help="quantize the drafter to NVFP4 first")
    g.add_argument("--no-compare", action="store_true",
                   help="print the text and tau only: skip the autoregressive run and the tokens/s comparison")
    g.add_argument("--kind", choices=("dflash", "dflash2"), default="dflash", help="which shipped drafter")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over the first N token ids only (0: the whole vocabulary; default: the drafter's "
                        "config)")
    g.add_argument("--model", choices=("smollm2", "code-5m"), default=None,
                   help="which shipped model (default: $DFLASH_JAX_DEFAULT_MODEL, else smollm2, the packaged "
                        "SmolLM2-135M-Instruct with the drafter trained for it)")
    g.add_argument("--raw", action="store_true",
                   help="continue the prompt as text instead of sending it through the model's chat template")
    b = sub.add_parser("bench", help="speculative vs autoregressive, one run, medians")
    b.add_argument("--new-tokens", type=int, nargs="+", default=None,
                   help="output lengths to measure, one table row each (default 128 512 1024; --bf16-exactness: 256)")
    b.add_argument("--prompts", type=int, default=None,
                   help="held-out stdlib prompts, run one at a time (default 8; --bf16-exactness: 32, batched)")
    b.add_argument("--draft-length", type=int, default=None,
                   help="tokens drafted per step (default: block_size-1; 7 with --nvfp4; with --tau-table: only this length "
                        "instead of 3, 7 and 15)")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompt sample and of sampling")
    b.add_argument("--nvfp4", action="store_true", help="add NVFP4 drafters with and without tensor scales")
    b.add_argument("--random-tiny", action="store_true", help="random tiny models: per-step cost split")
    b.add_argument("--model", choices=("smollm2", "code-5m"), default=None,
                   help="which shipped model (default: $DFLASH_JAX_DEFAULT_MODEL, else smollm2)")
    b.add_argument("--tau-table", action="store_true", help="tau at draft lengths 3/7/15 (+ NVFP4 with --nvfp4)")
    b.add_argument("--step-table", action="store_true",
                   help="per draft length (1/3/7, or --draft-length) and draft vocabulary (whole, first 8192, "
                        "first 4096 ids), then per draft-tree budget (--tree-budgets): verify and draft cost (r, c), "
                        "tau, predicted and measured speedup")
    b.add_argument("--reps", type=int, default=30, help="with --step-table: timed rounds per step cost (default 30)")
    b.add_argument("--tree-budgets", type=int, nargs="*", default=[4, 8, 16, 32],
                   help="with --step-table: draft-tree rows, one per budget (nodes per step besides the root; "
                        "default 4 8 16 32; none: chains only)")
    b.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over the first N token ids only (0: the whole vocabulary; default: the drafter's "
                        "config)")
    b.add_argument("--calibration-anchors", type=int, default=8,
                   help="with --tau-table --nvfp4: draft blocks per calibration window (default 8). Each anchor is "
                        "one eager draft pass of its own context length (its own op compiles): the tests' shrunk "
                        "run takes 2")
    b.add_argument("--pair-table", action="store_true",
                   help="dense and NVFP4 drafter: tau and speedup at draft lengths 7 and 15 (or --draft-length), "
                        "greedy and T 0.7 (or --temperature), at each --new-tokens")
    b.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default); > 0 = rejection sampling (then 'exact' is not expected to hold); "
                        "--pair-table runs 0 and 0.7 unless given")
    b.add_argument("--bf16-exactness", action="store_true",
                   help="greedy speculative vs autoregressive with the shipped pair in bfloat16 compute: mismatch rate "
                        "(rows differing) and first-divergence position (default 32 prompts x 256 tokens, batched)")
    b.add_argument("--device-report", action="store_true",
                   help="the prepared GPU run (dflash_jax/bench/device_report.py): linear timings per backend, step costs, "
                        "embedded pair; writes device_report.json/.md into --out")
    b.add_argument("--smoke", action="store_true", help="with --device-report: tiny shapes, runs on CPU")
    b.add_argument("--out", default=None, help="with --device-report: output folder")
    b.add_argument("--gguf-roundtrip", action="store_true",
                   help="NVFP4 drafters (DFlash, and DFlash2 when one exists) vs the same written with save_gguf and "
                        "read back, and vs that file with its attention .scale tensors set to 1.0 (the llama.cpp bug): "
                        "tau and acceptance rate intact vs broken, and the audit of both files; --model picks the "
                        "pair (--model smollm2 --seed 1: the SmolLM2 drafter's own held-out eval prompts)")
    b.add_argument("--dflash2", default=None,
                   help="with --nvfp4 / --tau-table: a DFlash2 drafter folder (default: the shipped one)")
    q = sub.add_parser("quality", help="the target as a language model: held-out loss and repetition (seq-rep-4)")
    q.add_argument("--target", default=None, help="a target folder to measure (default: the shipped target)")
    q.add_argument("--prompts", type=int, default=16, help="held-out prompts to continue greedily")
    q.add_argument("--max-new-tokens", type=int, default=256, help="tokens per greedy continuation")
    q.add_argument("--show", type=int, default=2, help="hand-written prompts whose continuation is printed")
    q.add_argument("--seed", type=int, default=0, help="seed of the held-out prompt sample")
    q.add_argument("--windows", type=int, default=64,
                   help="held-out loss windows of 256 tokens (a quarter as many of 1024; default 64)")
    au = sub.add_parser("audit", help="NVFP4 scale audit of a model file; exits 1 when a scale is flagged",
                        description="Audit the NVFP4 scales of a llama.cpp dflash GGUF drafter, an HF / ModelOpt "
                        "folder or a folder written by dflash_jax.save: a table of every per-tensor scale, flagging "
                        "missing, zero, negative, NaN/inf, exactly-1.0 and outlier values, and the graph check that "
                        "every scale reaches the output (audit_scales). Exit status: 0 all clear, 1 something "
                        "flagged, 2 the file could not be read.")
    au.add_argument("path", help="a .gguf file or a model folder")
    au.add_argument("--target", default=None,
                    help="target folder the drafter runs with for the graph check (default: a random stand-in)")
    au.add_argument("--no-graph", action="store_true", help="only the scale table (no forward pass)")
    au.add_argument("--vocab-size", type=int, default=None, help="for a GGUF that does not record its vocabulary")
    au.add_argument("--num-target-layers", type=int, default=None,
                    help="for a GGUF that does not record its target's depth")
    sub.add_parser("train-target", help="reproduce checkpoints/target", add_help=False)
    sub.add_parser("train-drafter", help="reproduce checkpoints/drafter (--kind dflash2: checkpoints/drafter2)",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("train-target", "train-drafter"):
        rest = argv[1:]
        if argv[0] == "train-target":
            from dflash_jax.train.target import main as train_main
        else:
            kind_ap = argparse.ArgumentParser(add_help=False)
            kind_ap.add_argument("--kind", choices=("dflash", "dflash2"), default="dflash")
            kind, rest = kind_ap.parse_known_args(rest)
            if kind.kind == "dflash2":
                from dflash_jax.train.drafter2 import main as train_main
            else:
                from dflash_jax.train.drafter import main as train_main
        return train_main(rest)
    args = ap.parse_args(argv)
    if args.cmd == "audit":
        return _audit(args)
    if args.cmd == "generate":
        _generate(args)
    elif args.cmd == "quality":
        _quality(args)
    elif args.cmd == "bench":
        if args.calibration_anchors < 1:
            ap.error(f"--calibration-anchors must be >= 1, got {args.calibration_anchors}")
        if args.temperature is None and not args.pair_table:
            args.temperature = 0.0
        if args.nvfp4 and args.draft_length is None and not args.tau_table:
            args.draft_length = 7  # the original report's setting
        _bench(args)


if __name__ == "__main__":
    sys.exit(main())
