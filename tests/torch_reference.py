"""float64 torch building blocks for the independent restatements of z-lab's drafters (test_drafter_reference.py,
test_dflash2_reference.py). They are written from the papers' definitions, not from dflash_jax, so that a shared
mistake cannot hide in both sides of a comparison."""
from __future__ import annotations

import numpy as np
import torch

from dflash_jax.params import named_leaves


def tt(x) -> torch.Tensor:
    """Any array as a float64 torch tensor."""
    return torch.from_numpy(np.asarray(x, np.float64))


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta, factor):
    """NeoX rotate-half RoPE over the full head_dim. x [B, T, n, hd], pos [T] absolute positions."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = (pos.to(torch.float64) / factor)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def torch_inputs(drafter, target, features, block):
    """What both drafter restatements start from, in float64: the drafter's weights and the target's (by flat name),
    the LM head (the embedding when tied), the features [B, C, K*H] and the block [B, bs] (int64)."""
    w = {k: tt(v) for k, v in named_leaves(drafter.params).items()}
    tw = {k: tt(v) for k, v in named_leaves(target.params).items() if v is not None}
    head = tw["embed_tokens"] if target.config.tie_word_embeddings else tw["lm_head"]
    return w, tw, head, tt(features), torch.from_numpy(np.asarray(block, np.int64))
