"""Random tiny models for tests, drawn with numpy (no per-leaf XLA compiles)."""

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dj
from dflash_jax.params import abstract_drafter, abstract_target, is_spec, path_name


def random_params(abstract, seed: int, std: float | None = None):
    """std=None: O(1) activations (linears N(0, 1/in), embeddings N(0, 1), norms 1 + 0.3 N(0, 1)), so that tap
    off-by-ones and norm mix-ups show and greedy text is diverse (the std-0.02 init makes every layer ~identity);
    std=s: the usual N(0, s^2) init with unit norms."""
    rng = np.random.default_rng(seed)

    def draw(path, spec):
        name = path_name(path)
        if len(spec.shape) == 1:
            w = np.ones(spec.shape) if std is not None else 1.0 + 0.3 * rng.standard_normal(spec.shape)
        elif std is not None:
            w = std * rng.standard_normal(spec.shape)
        elif name in ("embed_tokens", "lm_head"):
            w = rng.standard_normal(spec.shape)
        else:
            w = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[1])
        return jnp.asarray(w, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract, is_leaf=is_spec)


def make_target(cfg, seed: int, std: float | None = None) -> dj.Target:
    return dj.Target(params=random_params(abstract_target(cfg), seed, std), config=cfg)


def make_drafter(cfg, seed: int, std: float | None = None) -> dj.Drafter:
    return dj.Drafter(params=random_params(abstract_drafter(cfg), seed, std), config=cfg)


def nontrivial_dflash2(params, seed: int, *, codebook_scale: float = 3.0, tap_scale: float = 0.5,
                       proj_scale: float = 1.0):
    """A DFlash2 drafter's conv and selector made non-trivial: random base kernels around the identity (tap 0 ~ 1,
    other taps clearly non-zero), random dynamic-tap and hidden projections, codebooks scaled so that the pair term
    competes with the logits. Other parameters are returned unchanged."""
    from dflash_jax.params import map_named

    rng = np.random.default_rng(seed)

    def f(name, x):
        x = np.asarray(x)
        if name.endswith("base_kernel"):
            w = tap_scale * rng.standard_normal(x.shape) + (np.arange(x.shape[1]) == 0)[None, :, None]
        elif name.endswith("kernel_projection"):
            w = proj_scale * rng.standard_normal(x.shape) / np.sqrt(x.shape[1])
        elif name.endswith("_codebook"):
            w = codebook_scale * rng.standard_normal(x.shape) / np.sqrt(x.shape[1])
        elif name.endswith("hidden_projection"):
            w = rng.standard_normal(x.shape) / np.sqrt(x.shape[1])
        else:
            return jnp.asarray(x)
        return jnp.asarray(w, jnp.float32)

    return map_named(f, params)
