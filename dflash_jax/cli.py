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
import statistics
import sys


def _generate(args):
    from dflash_jax import generate, generate_autoregressive
    from dflash_jax.io.shipped import load_default

    try:
        target, drafter, tok = load_default(model=args.model, drafter=args.kind)
    except FileNotFoundError as e:  # e.g. the model package is not installed: the message says how to install it
        raise SystemExit(f"error: {e}") from None
    if args.draft_vocab is not None:
        from dflash_jax.bench.command import with_draft_vocab
        drafter = with_draft_vocab(drafter, args.draft_vocab)
    if args.draft_length is not None:
        from dflash_jax.bench.command import check_draft_length
        check_draft_length(args.draft_length, [drafter])
    if args.nvfp4:
        from dflash_jax.quant.quantize import quantize_nvfp4
        drafter = quantize_nvfp4(drafter)
    if not args.prompt.strip():
        raise SystemExit("error: the prompt is empty")
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}")
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
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              eos_ids=(tok.eos_id,), seed=args.seed, prefill_timing="rerun")
    if args.no_compare:  # the text alone: one speculative run, nothing timed
        sp = generate(target, drafter, [ids], draft_length=args.draft_length, tree_budget=args.tree_budget,
                      context_lookup=args.context_lookup, draft_pass=args.draft_pass, **kw)
        print(show(sp.token_lists()[0]))
        print("-" * 72)
        print(f"{int(sp.num_tokens[0])} tokens in {sp.num_steps} steps: {_acceptance(sp)}")
        return
    # Each program runs once before it is timed: a first execution pays one-time costs (allocations, thread pools).
    # That first run decodes 2 tokens where the budget is a traced value of the same program (one budget bucket),
    # else the whole budget.
    first = dict(kw, max_new_tokens=_same_program_budget(args.max_new_tokens))

    def speculative(run):
        return generate(target, drafter, [ids], draft_length=args.draft_length, tree_budget=args.tree_budget,
                        context_lookup=args.context_lookup, draft_pass=args.draft_pass, **run)
    ar, sp = generate_autoregressive(target, [ids], **first), speculative(first)
    # The timed runs alternate which goes first, and the line quotes medians: one pair of runs on a shared CPU moved
    # the ratio by +-10% between invocations.
    speeds = []
    for i in range(args.repeats):
        if i % 2:
            sp, ar = speculative(kw), generate_autoregressive(target, [ids], **kw)
        else:
            ar, sp = generate_autoregressive(target, [ids], **kw), speculative(kw)
        speeds.append((sp.decode_tokens_per_second, ar.decode_tokens_per_second))
    print(show(sp.token_lists()[0]))
    print("-" * 72)
    same = "identical to" if sp.token_lists() == ar.token_lists() else "differs from (sampling)"
    print(f"{'DFlash2' if args.kind == 'dflash2' else 'DFlash'} output {same} autoregressive output; "
          f"{int(sp.num_tokens[0])} tokens, {sp.num_steps} steps")
    print(_acceptance(sp))
    runs = f"medians of {len(speeds)} alternated runs; " if len(speeds) > 1 else ""
    print(_speed_line(sp, ar, speeds) + f"  (prefill {1e3 * sp.timings['prefill_s']:.1f} ms; {runs}compile and first "
          f"run excluded{_kernel_note(target)})")


def _speed_line(sp, ar, speeds: list[tuple[float, float]] | None = None) -> str:
    """The decode speeds (with `speeds`, the (speculative, autoregressive) tokens/s of alternated runs: the median
    of each side), and their ratio where the speculative run drafted: where
    `generate` decoded plainly (its step table predicts no speedup), both runs are the same program, and a ratio
    would only be noise."""
    speeds = speeds or [(sp.decode_tokens_per_second, ar.decode_tokens_per_second)]
    s, a = (statistics.median(x[i] for x in speeds) for i in (0, 1))
    if sp.draft_length == 0:
        return (f"decode tokens/s: {s:.1f}, plain decoding (the drafter's step table predicts no speedup here; "
                f"--draft-length or --tree-budget speculates anyway); the autoregressive run, the same program: "
                f"{a:.1f}")
    return f"decode tokens/s: DFlash {s:.1f} vs autoregressive {a:.1f} -> {s / a:.2f}x"


def _same_program_budget(max_new_tokens: int) -> int:
    """The fewest new tokens (at least 2: the prefill's and one step's) whose run is the program a run of
    max_new_tokens runs (the budget is traced; only its bucket keys the program)."""
    from dflash_jax.decode import buckets  # lazily: `dflash-jax --help` imports no JAX

    short = min(2, max_new_tokens)
    return short if buckets.budget_bucket(short) == buckets.budget_bucket(max_new_tokens) else max_new_tokens


def _kernel_note(target=None) -> str:
    """Which build of the CPU matmul kernel ran (its speed differs by an order of magnitude between them), and where
    a GGUF target's blocks ran with float32 activations where Q8 activations decode faster, that they exist: on an
    AVX2 CPU they doubled the decode speed, on a Zen 4 EPYC (VNNI, 512-bit operations on 256-bit units) they gave
    ~1.3x; on a Zen 5 (full-width units) they decode at the float32 speed. Where the CPU has AVX512-BF16 generation
    takes bfloat16 products by default (a verify's rows cheaper; docs/cpu-step.md): the note says so, and how to
    turn them off."""
    import jax  # lazily: `dflash-jax --help` imports no JAX

    from dflash_jax.quant import cpu_kernel  # lazily, as above
    if jax.default_backend() != "cpu":
        return ""
    if not cpu_kernel.available():
        return "; no CPU kernel: XLA's dot"
    from dflash_jax import execution  # lazily, as above
    from dflash_jax.quant.products import generation_bf16_products  # lazily, as above
    if execution.current().q8_activations:
        return f"; CPU kernel: {cpu_kernel.isa()} build, Q8 activations"
    from dflash_jax.params import named_leaves  # lazily, as above
    from dflash_jax.quant.ggml import GGMLArray  # lazily, as above
    ggml_target = target is not None and any(isinstance(x, GGMLArray) for x in named_leaves(target.params).values())
    if generation_bf16_products():
        chosen = execution.current().bf16_products is not None
        return (f"; CPU kernel: {cpu_kernel.isa()} build, bfloat16 products" +
                ("" if chosen or not ggml_target else " (AVX512-BF16's dot product, this CPU's default; "
                 "--f32-products for float32 ones)"))
    if not ggml_target:
        return f"; CPU kernel: {cpu_kernel.isa()} build"
    hint = ""
    if cpu_kernel.isa() != "avx512" or (cpu_kernel.q8_has_vnni() and cpu_kernel.avx512_on_256_bit_units()):
        gain = ("~1.3x the decode speed on this CPU (AVX-512 VNNI on 256-bit units)" if cpu_kernel.isa() == "avx512"
                else "~2x the decode speed on this build")
        hint = f" (--q8-activations: llama.cpp's integer dot, {gain})"
    return f"; CPU kernel: {cpu_kernel.isa()} build{hint}"


def _acceptance(res) -> str:
    if res.draft_length == 0:  # nothing drafted: one token a step, no acceptance rate
        return f"tau {res.tau:.2f} (no drafts: {_drafted(res)})"
    return (f"tau {res.tau:.2f} (tokens per draft+verify step, incl. bonus), acceptance rate "
            f"{100 * res.acceptance_rate:.1f}% of {_drafted(res)} per step")


def _drafted(res) -> str:
    """What a step drafted: a chain of D tokens, or a draft tree (its depth bounds what a step accepts)."""
    if res.tree_budget:
        over = ", drafted from the tree's depth only" if res.draft_pass == "drafted" else ""
        copied = (f"; or the continuation of a {res.context_lookup}+ token repeat in the text, where one exists"
                  if res.context_lookup else "")
        return f"depth {res.draft_length} (a draft tree of {res.tree_budget} nodes{over}{copied})"
    if res.draft_length == 0:
        return "none (plain decoding: the drafter's step table predicts no speedup here)"
    notes = ["a draft pass over the drafted slots only"] if res.draft_pass == "drafted" else []
    if res.context_lookup:
        notes.append(f"the first copied from the continuation of a {res.context_lookup}+ token repeat in the text, "
                     "where one exists")
    return f"{res.draft_length} drafted" + (f" ({'; '.join(notes)})" if notes else "")


def _bench(args):
    from dflash_jax.bench import command  # lazily: `dflash-jax --help` imports no JAX

    return command.run(args)



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


def _compilation_cache():
    """The command's default, switched on once a command is about to run (after --help and argument errors, which
    load no JAX); DFLASH_JAX_NO_COMPILE_CACHE=1 turns it off."""
    from dflash_jax.io.compile_cache import enable_compilation_cache

    enable_compilation_cache()


def _add_filters(parser):
    """--top-p / --top-k: the sampling filters at temperature > 0 (target and drafter alike; no effect when greedy)."""
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="at temperature > 0: sample from the smallest set of most likely tokens whose mass "
                             "reaches P (0 < P <= 1; default 1: off)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="at temperature > 0: sample from the K most likely tokens (default 0: off)")


def _check_filters(ap, args):
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        ap.error(f"--top-k must be >= 0 (0: off), got {args.top_k}")


def main(argv=None):
    from dflash_jax.bench.flags import add_product_flags  # lazily, as above

    ap = argparse.ArgumentParser(prog="dflash-jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from a prompt with the embedded models")
    g.add_argument("prompt", help="a request to an instruct model (sent through its chat template), or text to "
                                  "continue (code-5m, or --raw)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--draft-length", type=int, default=None,
                   help="tokens drafted per step, 1..block_size-1 (default: the best row of the drafter's step table "
                        "for this pair and platform, a chain or a draft tree; without one block_size-1)")
    g.add_argument("--tree-budget", type=int, default=None,
                   help="draft a tree of N nodes per step instead of a chain (one choice with --draft-length)")
    g.add_argument("--context-lookup", type=int, default=None, metavar="K",
                   help="a step whose text (prompt and output) ends in a repeat of K+ tokens verifies what followed "
                        "its last occurrence instead of the drafter's tree or first drafts (same cost and output; "
                        "default 2 with a tree; with a chain, the step table's row's where the table chose it, else 0; "
                        "0: off)")
    g.add_argument("--draft-pass", choices=("block", "drafted"), default=None,
                   help="the block a draft pass reads: the whole block (z-lab's) or the drafted slots only (default: "
                        "the step table's best row's, else the whole block)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (output identical to autoregressive); > 0 = lossless rejection sampling")
    _add_filters(g)
    g.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    g.add_argument("--nvfp4", action="store_true", help="quantize the drafter to NVFP4 first")
    g.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each decoder, alternated; the speeds printed are their medians (default 3)")
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
    add_product_flags(g)
    b = sub.add_parser("bench", help="speculative vs autoregressive, one run, medians")
    add_product_flags(b)
    b.add_argument("--new-tokens", type=int, nargs="+", default=None,
                   help="output lengths to measure, one table row each (default 128 512 1024; --bf16-exactness: 256)")
    b.add_argument("--prompts", type=int, default=None,
                   help="held-out stdlib prompts, run one at a time (default 8; --bf16-exactness: 32, batched)")
    b.add_argument("--draft-length", type=int, default=None,
                   help="tokens drafted per step, 1..block_size-1 of the loaded drafter (default: block_size-1, at "
                        "most 7 with --nvfp4; --tau-table / --step-table: only this length instead of those of 3/7/15 "
                        "and 1/3/7 the drafter's block holds; --pair-table: this chain instead of generate's choice)")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompt sample and of sampling")
    b.add_argument("--nvfp4", action="store_true", help="add NVFP4 drafters with and without tensor scales")
    b.add_argument("--random-tiny", action="store_true", help="random tiny models: per-step cost split")
    b.add_argument("--model", choices=("smollm2", "code-5m"), default=None,
                   help="which shipped model (default: $DFLASH_JAX_DEFAULT_MODEL, else smollm2)")
    b.add_argument("--tau-table", action="store_true",
                   help="tau at the draft lengths of 3/7/15 the drafter's block holds (+ NVFP4 with --nvfp4)")
    b.add_argument("--step-table", action="store_true",
                   help="per draft length (those of 1/3/7 the block holds, or --draft-length), draft vocabulary (the "
                        "drafter's own, or --draft-vocabs) and batch (--batches), then per draft-tree budget "
                        "(--tree-budgets): verify and draft cost (r, c), tau, predicted and measured speedup")
    b.add_argument("--reps", type=int, default=30, help="with --step-table: timed rounds per step cost (default 30)")
    b.add_argument("--draft-passes", choices=("block", "drafted"), nargs="+", default=None,
                   help="with --step-table: draft passes to measure, each its own rows: the whole block (z-lab's) "
                        "and/or the drafted slots only (default: the drafter's own); generate runs the best row's")
    b.add_argument("--chain-lookup", type=int, default=None, metavar="K",
                   help="with --step-table: the chain rows' context lookup, measured and saved with them (default 2, "
                        "none for a DFlash2 drafter; 0: z-lab's loop), which generate then runs with a chain row")
    b.add_argument("--draft-vocabs", type=int, nargs="+", default=None,
                   help="with --step-table: draft vocabularies to compare (first N ids; 0: the whole vocabulary)")
    b.add_argument("--batches", type=int, nargs="+", default=[1],
                   help="with --step-table: batch sizes (rows per generate call; default 1)")
    b.add_argument("--save-table", nargs="?", const="", default=None, metavar="FOLDER",
                   help="with --step-table: write the table as step_table.json into FOLDER (default: the shipped "
                        "drafter's folder), where loading the drafter picks it up: generate's default (a chain of D "
                        "drafts or a draft tree) is then its best row for the running pair")
    b.add_argument("--tree-budgets", type=int, nargs="*", default=None,
                   help="with --step-table: draft-tree rows, one per budget (nodes per step besides the root; "
                        "default 4 8 16 32; none: chains only); with --pair-table: tree rows instead of the chains "
                        "(beside them with --draft-length)")
    b.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over the first N token ids only (0: the whole vocabulary; default: the drafter's "
                        "config)")
    b.add_argument("--calibration-anchors", type=int, default=8,
                   help="with --tau-table --nvfp4: draft blocks per calibration window (default 8). Each anchor is "
                        "one eager draft pass of its own context length (its own op compiles): the tests' shrunk "
                        "run takes 2")
    b.add_argument("--pair-table", action="store_true",
                   help="dense and NVFP4 drafter: tau and speedup with generate's own choice (the step table's "
                        "best row), or at --draft-length and / or --tree-budgets, greedy and T 0.7 (or "
                        "--temperature), at each --new-tokens")
    b.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default); > 0 = rejection sampling (then 'exact' is not expected to hold); "
                        "--pair-table runs 0 and 0.7 unless given")
    _add_filters(b)
    b.add_argument("--bf16-exactness", action="store_true",
                   help="greedy speculative vs autoregressive with the shipped pair in bfloat16 compute: mismatch rate "
                        "(rows differing) and first-divergence position (default 32 prompts x 256 tokens, batched)")
    b.add_argument("--device-report", action="store_true",
                   help="the prepared GPU run (dflash_jax/bench/device_report.py): linear timings per backend, step "
                        "costs, embedded pair; writes device_report.json/.md into --out")
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
                from dflash_jax.train.drafter_run import main as train_main
        _compilation_cache()
        return train_main(rest)
    args = ap.parse_args(argv)
    if args.cmd in ("generate", "bench"):
        _check_filters(ap, args)
    _compilation_cache()
    if args.cmd == "audit":
        return _audit(args)
    if args.cmd == "bench":
        if args.calibration_anchors < 1:
            ap.error(f"--calibration-anchors must be >= 1, got {args.calibration_anchors}")
        if args.temperature is None and not args.pair_table:
            args.temperature = 0.0
    from dflash_jax.quant.products import products_scope  # JAX: once a command runs

    with products_scope(args):
        {"generate": _generate, "quality": _quality, "bench": _bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
