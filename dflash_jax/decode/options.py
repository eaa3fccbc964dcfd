"""How one generation call runs, besides how its tokens are chosen: `GenerationOptions`, the frozen companion of
`SamplingParams`, and the one reading of the public calls' keywords into the two.

`generate`, `generate_autoregressive`, `speculative_call` and `autoregressive_call` take their settings as keywords
(a public contract) and turn them into (SamplingParams, GenerationOptions) once, here; everything after that takes
the pair. The keyword list is written out once: the fields of `GenerationOptions` and the parameters of
`SamplingParams.make` (the public calls' signatures are built from them, `keyword_signature`). A new setting is one
field here.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.frozen import Replaceable


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationOptions(Replaceable):
    """Everything a generation call takes besides the models, the prompt and the sampling settings. Checked where it
    is used (the prompt, the budget and the drafter's block decide what is valid)."""

    max_new_tokens: int  # tokens to generate per row (the first comes from prefill)
    # Drafted tokens per step, 1..block_size-1; None: the best of the drafter's measured step table for this pair,
    # platform and batch (`decode.draft_length`), else block_size - 1. Speculative decoding only (a draft tree is the
    # field beside it: `tree_budget`).
    draft_length: int | None = None
    # A draft tree of this many nodes besides the root per step (DDTree) instead of a chain: built on device from the
    # block's per-position distributions, verified in one target pass, walked with the target's own tokens (same
    # output law as the chain at every temperature). One choice with draft_length (give one of them): the tree's
    # depth follows from its budget and the drafter's block, min(tree_budget, block_size - 1). None: the chain.
    # DFlash drafters only (DFlash2's selector drafts sequentially).
    tree_budget: int | None = None
    # Context lookup: a row whose text (its prompt's last 512 tokens, then its output) ends in a repeat of at least
    # this many tokens verifies the continuation of their last occurrence instead of the drafter's proposals that
    # step: a tree's nodes become that chain (up to the tree's depth; the target's own tokens walked as for any tree),
    # a chain's first drafts become it (verified against a point-mass q). The output is unchanged in law (greedy:
    # token for token); only acceptance moves (`decode.lookup`). None: 2 with a tree (measured best, docs/cpu-step.md
    # "Context lookup"); with a chain, its step-table row's where generate takes the chain from the table (the row
    # measured it: `StepRow.context_lookup`), else 0 (z-lab's loop: a chain's copies replace a strong drafter's
    # drafts, so it is measured per pair); 0: off. Not with a DFlash2 chain.
    context_lookup: int | None = None
    # The block the draft pass reads: "block" (z-lab's: the whole block) or "drafted" (the last token and one mask
    # per drafted slot; `DrafterConfig.draft_pass`). None: the drafter's own setting, else the step table's best row's
    # when generate takes its layout from the table, else "block". Output is the same either way in law (greedy:
    # token for token); only acceptance and the draft's cost move.
    draft_pass: str | None = None
    eos_ids: Any = None  # None = the target config's `eos_token_id`; () = no EOS; or an id / ids
    seed: int = 0  # one key stream per row, folded from this seed
    max_cache_len: int | None = None  # a context limit below the target's max_position_embeddings
    nvfp4_backend: str | None = None  # for NVFP4 weights (`dflash_jax.quant.linear`); None = resolved per call
    # "stamp": one host callback marks the end of prefill; "rerun": prefill timed by a second run (no callback)
    prefill_timing: str = "stamp"
    attention_mask: Any = None  # [B, T] 0/1 for a padded int prompt (left- or right-padded rows)
    prompt_lengths: Any = None  # [B] for a right-padded int prompt
    return_prompt: bool = False  # `tokens` holds each row's prompt, then its new tokens
    # With neither draft_length nor tree_budget given: where the drafter's step table applies and predicts even its
    # best setting no faster than plain decoding for this batch (a gain under the table's 5% noise margin;
    # `decode.draft_length.slower_than_plain`), decode plainly (the same tokens at temperature 0, the target's law
    # above it; the result's draft_length is 0). False:
    # speculate with that best setting anyway (benchmarks that measure it).
    plain_when_slower: bool = True
    # GGML targets and drafters on a CPU: x rounded to Q8 blocks in their products, llama.cpp's integer dot (the
    # execution context's `q8_activations`; ~1.6x the decode speed on an AVX2 CPU, docs/cpu-step.md). Another function
    # of the prompt than the float products, the same for autoregressive and speculative decoding (greedy output stays
    # identical between them). False: the caller's context decides (off by default).
    q8_activations: bool = False
    # GGML targets on a CPU: their weights and x rounded to bfloat16 in the products, one `vdpbf16ps` per 32 weights
    # and row (the execution context's `bf16_products`; a verify 5-16% cheaper against a decode on a Zen 5,
    # docs/cpu-step.md). Another function of the prompt than the float products, the same for autoregressive and
    # speculative decoding. None: the caller's context decides, by default on where the CPU has AVX512-BF16 and Q8
    # activations are not asked for (`quant.products.generation_bf16_products`); False: float32 products.
    bf16_products: bool | None = None


# keywords autoregressive decoding does not take
SPECULATIVE_ONLY = ("draft_length", "tree_budget", "context_lookup", "draft_pass", "p_min", "draft_sampling",
                    "plain_when_slower")
_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationOptions))
_SAMPLING_DEFAULTS = {name: p.default for name, p in inspect.signature(SamplingParams.make).parameters.items()
                      if name != "cls"}


def _keywords(speculative: bool) -> tuple[str, ...]:
    names = (*_OPTION_FIELDS, *_SAMPLING_DEFAULTS)
    return names if speculative else tuple(n for n in names if n not in SPECULATIVE_ONLY)


def _sampling(sampling: SamplingParams | None, given: dict) -> SamplingParams:
    """The sampling keywords, or a `SamplingParams` given as `sampling=` (then no sampling keyword may differ from
    its default)."""
    if sampling is None:
        return SamplingParams.make(**given)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a dflash_jax.SamplingParams, got {type(sampling).__name__}")
    changed = sorted(k for k, v in given.items() if v != _SAMPLING_DEFAULTS[k])
    if changed:
        raise ValueError(f"give sampling settings either as sampling= or as keywords, not both (got sampling= and "
                         f"{changed})")
    # greedy is derived from the temperature here (a SamplingParams built by hand may carry the default flag)
    return SamplingParams.make(sampling.temperature, sampling.top_k, sampling.top_p, sampling.p_min,
                               sampling.draft_sampling)


def settings(call: str, keywords: dict, *, speculative: bool, sampling: SamplingParams | None = None,
             options: GenerationOptions | None = None) -> tuple[SamplingParams, GenerationOptions]:
    """A public call's keywords -> (SamplingParams, GenerationOptions). `options=` may stand for the generation
    keywords (not together with them); keywords a call does not take raise TypeError, as Python would."""
    allowed = _keywords(speculative)
    unknown = [k for k in keywords if k not in allowed]
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}")
    given_sampling = {k: keywords.get(k, d) for k, d in _SAMPLING_DEFAULTS.items() if k in allowed}
    given_options = {k: v for k, v in keywords.items() if k in _OPTION_FIELDS}
    if options is not None:
        if not isinstance(options, GenerationOptions):
            raise ValueError(f"options must be a dflash_jax.GenerationOptions, got {type(options).__name__}")
        if given_options:
            raise ValueError(f"give generation settings either as options= or as keywords, not both (got options= "
                             f"and {sorted(given_options)})")
        for name in ("draft_length", "tree_budget", "context_lookup", "draft_pass"):
            if not speculative and getattr(options, name) is not None:
                raise ValueError(f"{name} is a speculative setting: autoregressive decoding does not take it")
    elif "max_new_tokens" not in given_options:
        raise TypeError(f"{call}() missing 1 required keyword-only argument: 'max_new_tokens'")
    else:
        options = GenerationOptions(**given_options)
    return _sampling(sampling, given_sampling), options


def keyword_signature(*, speculative: bool) -> Callable[[Callable], Callable]:
    """A decorator: `fn` (which takes `**keywords`) gets the signature of the keywords it accepts, for `help()` and
    `inspect.signature`: its positional parameters, every setting with its default (max_new_tokens required), then
    its own keyword-only parameters (`options=`, `sampling=`)."""
    fields = {f.name: f for f in dataclasses.fields(GenerationOptions)}

    def default(name):
        if name not in fields:
            return _SAMPLING_DEFAULTS[name]
        f = fields[name]
        return inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        positional = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        own = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        keywords = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default(n))
                    for n in _keywords(speculative)]
        fn.__signature__ = sig.replace(parameters=[*positional, *keywords, *own])
        return fn

    return decorate


__all__ = ["GenerationOptions", "SPECULATIVE_ONLY", "keyword_signature", "settings"]
