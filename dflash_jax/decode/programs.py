"""Speculative generation (draft -> verify -> accept) and the autoregressive baseline: TWO compiled programs each.

Programs: `prefill` (prompt -> caches + the logits of each row's last prompt token, prefill.py) and the generation
loop (first token, then the `lax.while_loop`, loop.py). The handoff is one device-side value (`Prefilled`: caches,
lengths, logits), donated to the loop, so no host sync sits between them and the cache is not held twice. Prefill is
keyed on the prompt bucket; the loop is keyed only on the cache bucket, the batch bucket, the budget bucket, static
flags (draft length, greedy or sampled) and its execution context (the NVFP4 backend resolved on the host, the mesh,
the attention rule), so a new prompt bucket recompiles prefill alone.

Compilation: each program is a `jax.jit` function held here (the registry: `TRACE_COUNTS`, `compiled_counts`), so
its cache is keyed on everything that changes the program: shapes, dtypes, shardings and tree structure of the
arguments, the static arguments, and the execution context it is dispatched under (`dflash_jax.execution`, a JAX
user context: part of every jit cache key). Sampling numbers (temperature, top-k, top-p, p_min), the EOS ids (padded
to a fixed width) and the budgets (tokens, steps) are traced, so one program serves all their values. Buckets
(buckets.py) size the output buffer, the caches and the batch.

Attention over the caches inside the loop is chosen per platform when the call is prepared (the context's
`live_length_loop`, `buckets.uses_live_length_loop`): on accelerators every loop in a step has a static trip count
(attention masks the whole cache bucket), so the device never waits on the host inside a step; on CPU attention
visits only the blocks up to the longest live row, whose data-dependent trip count costs nothing there, so one large
cache bucket serves short and long prompts alike.

Calls: `generate` / `generate_autoregressive` run what `speculative_call` / `autoregressive_call` prepare (a
`ProgramCall`, call.py); their keywords become (SamplingParams, GenerationOptions) once (options.py).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from dflash_jax import execution
from dflash_jax.config import check_pair
from dflash_jax.decode import buckets
from dflash_jax.decode.draft_length import default_choice
from dflash_jax.decode.call import PROGRAM_PREFIX, ProgramCall, to_host
from dflash_jax.decode.lookup import PROMPT_WINDOW
from dflash_jax.decode.loop import Budget, autoregressive_loop, speculative_loop
from dflash_jax.decode.options import GenerationOptions, keyword_signature, settings
from dflash_jax.decode.prefill import prefill_program
from dflash_jax.decode.prepare import (check_budget, check_context_lookup, check_draft_length, check_tree,
                                       check_tree_fits, prepare_prompt, row_keys, unpad, warn_short_drafter_context)
from dflash_jax.decode.result import GenerationResult
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.models.drafter import Drafter, as_compiled
from dflash_jax.models.target import Target
from dflash_jax.params import committed
from dflash_jax.parallel import sharding as shd
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import cpu_kernel_runs, program_backend
from dflash_jax.quant.products import generation_bf16_products

# -- the registry of compiled programs -----------------------------------------------------------------------------

# Traces (= compiles) per program: "prefill" (shared by both generators), and the two loop programs.
TRACE_COUNTS: dict[str, int] = {"prefill": 0, "speculative": 0, "autoregressive": 0}


def _jit_program(name: str, program, static: tuple[str, ...], donate: tuple[int, ...] = (),
                 compiler_options: dict | None = None):
    """`program` under jax.jit with static `static` arguments; it reads the execution context it is dispatched
    under (`ProgramCall` enters it), which keys its cache too. Each trace (= each compile) bumps
    TRACE_COUNTS[name]. compiler_options: XLA options for these programs only (jax.jit's; the test suite compiles
    its large-batch programs with more optimisation than the rest)."""
    def traced(*args, **kwargs):
        TRACE_COUNTS[name] += 1
        return program(*args, **kwargs)

    traced.__name__ = traced.__qualname__ = f"{PROGRAM_PREFIX}{name}"
    # The loop takes the prefill handoff (argument 2) as donated: its caches are reused in place, not held twice.
    return jax.jit(traced, static_argnames=static, donate_argnums=donate, compiler_options=compiler_options)


PREFILL_STATIC = ("cache_len", "stamp", "lookup_window")
SPECULATIVE_STATIC = ("draft_length", "out_len", "tree_budget", "context_lookup")
AUTOREGRESSIVE_STATIC = ("out_len",)
_DEFS = {"prefill": (prefill_program, PREFILL_STATIC, ()),
         "speculative": (speculative_loop, SPECULATIVE_STATIC, (2,)),
         "autoregressive": (autoregressive_loop, AUTOREGRESSIVE_STATIC, (2,))}
# The jitted programs, built on first use (a test may swap in an empty dict to trace everything anew).
_COMPILED: dict = {}


def _program(name: str):
    if name not in _COMPILED:
        fn, static, donate = _DEFS[name]
        _COMPILED[name] = _jit_program(name, fn, static, donate)
    return _COMPILED[name]


def compiled_counts() -> dict[str, int]:
    """Executables held per program (jit cache entries): {"prefill": n, "speculative": n, "autoregressive": n}."""
    return {name: (_COMPILED[name]._cache_size() if name in _COMPILED else 0) for name in _DEFS}


# -- preparing a call ------------------------------------------------------------------------------------------------

def _as_compiled(model):
    """A model as its programs take it (`models.drafter.as_compiled` for a drafter; a target's arrays committed to
    its device), so that equal models compile once whatever way they were built."""
    if model is None:
        return None
    return as_compiled(model) if isinstance(model, Drafter) else committed(model)


def _prepare(name: str, target: Target, drafter: Drafter | None, prompt, sampling: SamplingParams,
             options: GenerationOptions) -> ProgramCall:
    """The call `name` ("speculative" | "autoregressive") prepared on the host: validated, padded to its buckets,
    placed on the models' mesh."""
    if options.prefill_timing not in ("stamp", "rerun"):
        raise ValueError(f"prefill_timing must be 'stamp' or 'rerun', got {options.prefill_timing!r}")
    models = (target,) if drafter is None else (target, drafter)
    mesh = shd.models_mesh(*models)  # refuses a pair on different meshes, or a mesh that cannot split a model
    vocab = target.config.vocab_size
    padded, lens = prepare_prompt(unpad(prompt, options.attention_mask, options.prompt_lengths), vocab)
    max_new = options.max_new_tokens
    limit = check_budget(target, lens, max_new, options.max_cache_len)
    eos = buckets.eos_set(buckets.default_eos_ids(target) if options.eos_ids is None else options.eos_ids, vocab)
    out_len = buckets.budget_bucket(int(max_new))
    # A host callback in a program spanning several processes would run in each of them: time prefill by a rerun.
    stamp = options.prefill_timing == "stamp" and (mesh is None or jax.process_count() == 1)
    # What the programs run under besides their arguments: the caller's context (its attention block size) with the
    # NVFP4 backend resolved now, on the host, the models' mesh and the platform's attention rule.
    cpu_loop = buckets.uses_live_length_loop(buckets.mesh_platform(mesh))
    for rounding in ("q8_activations", "bf16_products"):
        if getattr(options, rounding) and not cpu_kernel_runs():
            why = cpu_kernel.unavailable_reason() or "not a CPU"
            warnings.warn(f"{rounding}=True: the CPU kernel does not run here ({why}), so GGML products stay float32",
                          stacklevel=4)
    context = execution.current().replace(
        nvfp4_backend=program_backend(*models, backend=options.nvfp4_backend), mesh=mesh,
        # the CPU kernel takes whole weights: on a mesh of several devices it would all-gather every shard per step
        live_length_loop=cpu_loop, cpu_kernel=cpu_loop and (mesh is None or mesh.size == 1),
        q8_activations=resolved_q8_activations(options), bf16_products=resolved_bf16_products(options))
    if context.q8_activations and context.bf16_products:
        raise ValueError("q8_activations and bf16_products are two roundings of x for the same products: ask for one")
    D = 0 if drafter is None else options.draft_length
    extra = 1 if drafter is None else D + 1
    prefill_static = dict(cache_len=buckets.cache_slots(int(lens.max()), out_len, extra, limit), stamp=stamp)
    loop_static = dict(out_len=out_len)
    tree_budget = None if drafter is None else options.tree_budget
    if drafter is not None:
        loop_static["draft_length"] = D
    min_match = 0 if drafter is None else check_context_lookup(options.context_lookup, tree_budget,
                                                               drafter.config.is_dflash2)
    if tree_budget is not None:  # checked against the cache bucket here, before anything is traced
        check_tree_fits(tree_budget, prefill_static["cache_len"])
        loop_static["tree_budget"] = int(tree_budget)
    if drafter is not None:
        loop_static["context_lookup"] = min_match
        if min_match:  # the prompts' last tokens, handed to the loop for the search
            prefill_static["lookup_window"] = PROMPT_WINDOW
    budget = Budget(max_new=np.int32(max_new), max_steps=np.int32(int(max_new) - 1), eos=buckets.padded_eos(eos))
    batch = len(lens)
    # The batch is bucketed, and on a mesh it goes along "data": padded to a multiple of the axis too. Padding rows
    # are inert (length 0: done from the start, see `loop._init_state`); every row's key comes from its own stream,
    # so real rows draw the same whatever the padding.
    rows = buckets.batch_bucket(batch)
    if mesh is not None:
        rows = buckets.round_up(rows, int(mesh.shape["data"]))
    prompts = (tuple(tuple(int(t) for t in padded[b, :n]) for b, n in enumerate(lens)) if options.return_prompt
               else ())
    padded = np.concatenate([padded, np.zeros((rows - batch, padded.shape[1]), np.int32)])
    lens = np.concatenate([lens, np.zeros((rows - batch,), np.int32)])
    keys = row_keys(options.seed, rows)
    sampling = sampling.as_arrays()
    if mesh is not None:
        padded, lens, keys = (shd.place(x, shd.batch_sharding(mesh, x.ndim)) for x in (padded, lens, keys))
        sampling, budget = shd.place_tree((sampling, budget), shd.replicated(mesh))
    args = (_as_compiled(target), _as_compiled(drafter), padded, lens, keys, sampling, budget)
    return ProgramCall(name=name, args=args, prefill_static=prefill_static, loop_static=loop_static,
                       context=context, max_new=int(max_new), draft_length=D, tree_budget=tree_budget, eos=eos,
                       context_lookup=min_match,
                       prefill_program=_program("prefill"), loop_program=_program(name), batch=batch, prompts=prompts,
                       return_prompt=bool(options.return_prompt),
                       draft_pass=None if drafter is None else drafter.config.draft_pass)


def resolved_q8_activations(options: GenerationOptions) -> bool:
    """Whether the programs round x to Q8 blocks: the options' or the caller's context's `q8_activations`."""
    return options.q8_activations or execution.current().q8_activations


def resolved_bf16_products(options: GenerationOptions) -> bool:
    """Whether the programs take bfloat16 products: the options' setting, else the caller's context, else
    generation's default (`quant.products.generation_bf16_products`: on where the CPU has AVX512-BF16 and x is not
    rounded to Q8)."""
    if options.bf16_products is not None:
        return options.bf16_products
    return generation_bf16_products(q8=resolved_q8_activations(options))


def with_draft_pass(drafter: Drafter, draft_pass: str) -> Drafter:
    """The drafter drafting with `draft_pass` ("block" or "drafted"; refused by its config where it cannot: an
    unknown name, "drafted" for DFlash2)."""
    if drafter.config.draft_pass == draft_pass:
        return drafter
    try:
        return drafter.replace(config=drafter.config.replace(draft_pass=draft_pass))
    except ValueError as e:
        raise ValueError(f"draft_pass={draft_pass!r}: {e}") from None


def _speculative(target: Target, drafter: Drafter, prompt, sampling: SamplingParams,
                 options: GenerationOptions) -> ProgramCall:
    check_pair(drafter.config, target.config)
    if options.draft_pass is not None:
        drafter = with_draft_pass(drafter, options.draft_pass)
    if options.tree_budget is None and options.draft_length is None:
        # the drafter's measured best for this pair, platform and batch: a chain or a draft tree (a tree only where
        # the sampling rule allows one), else a chain of block_size - 1; plain decoding where even the best is slower
        trees = not sampling.use_p_min and sampling.draft_sampling == "sample"
        best = default_choice(drafter, target, batch=len(prompt) if hasattr(prompt, "__len__") else 1,
                              trees=trees, plain_when_slower=options.plain_when_slower,
                              q8=resolved_q8_activations(options), bf16=resolved_bf16_products(options),
                              sampled=not sampling.greedy)
        drafter = with_draft_pass(drafter, best.draft_pass)
        if best.draft_length == 0:
            return _prepare("autoregressive", target, None, prompt,
                            SamplingParams.make(sampling.temperature, sampling.top_k, sampling.top_p), options)
        N = best.tree_budget
        options = options.replace(draft_length=None if N else best.draft_length, tree_budget=N)
        if options.context_lookup is None and best.context_lookup is not None and not drafter.config.is_dflash2:
            options = options.replace(context_lookup=best.context_lookup)  # a chain row's lookup, as measured
    if options.tree_budget is None:
        options = options.replace(draft_length=check_draft_length(drafter, options.draft_length))
    else:  # the tree's depth stands for the draft length from here on (positions drafted, tokens per step - 1)
        options = options.replace(draft_length=check_tree(drafter, options.tree_budget, options.draft_length,
                                                          sampling))
    # the pass the loop runs, named (None and "block" are one program)
    drafter = with_draft_pass(drafter, drafter.config.draft_pass or "block")
    call = _prepare("speculative", target, drafter, prompt, sampling, options)
    warn_short_drafter_context(drafter, int(np.max(to_host(call.args[3]))) + int(options.max_new_tokens))
    return call


def _autoregressive(target: Target, prompt, sampling: SamplingParams, options: GenerationOptions) -> ProgramCall:
    if sampling.p_min != 0.0 or sampling.draft_sampling != "sample":
        raise ValueError("p_min and draft_sampling are speculative settings: autoregressive decoding takes neither")
    return _prepare("autoregressive", target, None, prompt, sampling, options)


# -- the public calls --------------------------------------------------------------------------------------------------

@keyword_signature(speculative=True)
def speculative_call(target: Target, drafter: Drafter, prompt, *, options: GenerationOptions | None = None,
                     sampling: SamplingParams | None = None, **keywords) -> ProgramCall:
    """What `generate` runs, prepared and validated on the host but not run (tests, benchmarks, inspection)."""
    return _speculative(target, drafter, prompt, *settings("speculative_call", keywords, speculative=True,
                                                           sampling=sampling, options=options))


@keyword_signature(speculative=False)
def autoregressive_call(target: Target, prompt, *, options: GenerationOptions | None = None,
                        sampling: SamplingParams | None = None, **keywords) -> ProgramCall:
    """What `generate_autoregressive` runs, prepared on the host but not run."""
    return _autoregressive(target, prompt, *settings("autoregressive_call", keywords, speculative=False,
                                                     sampling=sampling, options=options))


_CONVENTIONS_DOC = """
    Calling conventions (both generators):
      eos_ids: None (default) = the target config's `eos_token_id`; () = no EOS; or an id / ids. Generation of a row
        stops after its first EOS (the EOS is emitted).
      attention_mask: with a padded int prompt [B, T], HF-style [B, T] 0/1 (left- or right-padded rows); or
        prompt_lengths [B] for a right-padded batch. Padding is never read as tokens: each row's result is the one
        it gets alone (greedy). A list of token lists needs neither.
      sampling: a `SamplingParams` (`SamplingParams(temperature=0.7, top_p=0.9)`) instead of the sampling keywords;
        options: a `GenerationOptions` (`GenerationOptions(max_new_tokens=64, seed=1)`) instead of the others.
      return_prompt: `tokens` holds prompt + new tokens per row (HF-like, no padding before the new tokens);
        `result.decode(tokenizer)` gives one string per row.
      Batches run in a batch bucket (`batch_bucket`) with inert padding rows; prefill and the loop are two compiled
      programs (a new prompt-length bucket recompiles prefill only).
"""


@keyword_signature(speculative=True)
def generate(target: Target, drafter: Drafter, prompt, *, options: GenerationOptions | None = None,
             sampling: SamplingParams | None = None, **keywords) -> GenerationResult:
    """DFlash speculative generation: a prefill program, then one `lax.while_loop` program.

    prompt: int [B, T] or a list of token lists (rows may differ in length). Greedy (temperature 0) output equals
    `generate_autoregressive` token for token; at temperature > 0 rejection sampling keeps the target's distribution.
    Keywords: max_new_tokens (required) and the other fields of `GenerationOptions` (or `options=` one), and the
    sampling settings of `SamplingParams.make` (or `sampling=` one).
    nvfp4_backend: for NVFP4 weights (`dflash_jax.quant.linear`); None = the current default, resolved now, per call.
    prefill_timing: "stamp" = one host callback marks the end of prefill (such a prefill program never enters JAX's
    persistent compilation cache); "rerun" = no callback, prefill is timed by running the compiled prefill program
    once more (what the CLI and benchmarks use, with the persistent cache on; also what a mesh spanning several
    processes gets).

    Sharded models (`dflash_jax.parallel.sharding.shard`, or `load_target(..., mesh=)`): the prompt batch goes along
    the mesh's "data" axis (padded with inert rows when the axis does not divide it); the tokens are those of one
    device.
    """
    return _speculative(target, drafter, prompt, *settings("generate", keywords, speculative=True,
                                                           sampling=sampling, options=options)).run()


@keyword_signature(speculative=False)
def generate_autoregressive(target: Target, prompt, *, options: GenerationOptions | None = None,
                            sampling: SamplingParams | None = None, **keywords) -> GenerationResult:
    """Plain decoding with the same target, stopping rules, conventions and result type (prefill + one loop)."""
    return _autoregressive(target, prompt, *settings("generate_autoregressive", keywords, speculative=False,
                                                     sampling=sampling, options=options)).run()


generate.__doc__ += _CONVENTIONS_DOC
generate_autoregressive.__doc__ += _CONVENTIONS_DOC

__all__ = ["AUTOREGRESSIVE_STATIC", "PREFILL_STATIC", "SPECULATIVE_STATIC", "TRACE_COUNTS", "autoregressive_call",
           "compiled_counts", "generate", "generate_autoregressive", "speculative_call"]
