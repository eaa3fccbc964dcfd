"""Calibration activations for W4A4 drafters: the inputs every drafter linear sees on real text.

It runs the target and the drafter, so it lives with the models; `quant.quantize.collect_linear_inputs` records the
inputs and `quantize_nvfp4(drafter, calibration=...)` turns them into static input scales.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.models.drafter import draft_logits
from dflash_jax.models.target import target_forward
from dflash_jax.quant.quantize import collect_linear_inputs


def calibrate_drafter(target, drafter, token_windows, *, anchors_per_window: int = 8, seed: int = 0,
                      max_rows: int = 4096) -> dict[str, np.ndarray]:
    """Calibration activations for every drafter linear, from real text, as `quantize_nvfp4` takes them: for each
    token window [T], the target's features of the window, then drafter blocks anchored at random positions (context
    strictly before the anchor, as at inference), run eagerly through `collect_linear_inputs`. The anchor positions
    are drawn once and shared by every window, so each anchor is one batched draft pass over all windows: eager ops
    compile once per shape, and random per-window anchors made ~100 shapes (minutes of op compiles on a CPU)."""
    cfg = drafter.config
    rng = np.random.default_rng(seed)
    windows = np.asarray(token_windows, np.int32)
    if windows.ndim != 2 or windows.shape[1] < 10:
        raise ValueError(f"token_windows must be [n, T] with T >= 10, got shape {windows.shape}")
    if anchors_per_window < 1:
        raise ValueError(f"anchors_per_window must be >= 1, got {anchors_per_window}")
    feats = np.asarray(target_forward(target, windows, cfg.target_layer_ids)[1])
    contexts, blocks = [], []
    k = min(anchors_per_window, windows.shape[1] - 9)
    for a in np.sort(rng.choice(np.arange(8, windows.shape[1] - 1), size=k, replace=False)):
        contexts.append(feats[:, :a])  # [n, a, F]
        blk = np.full((len(windows), cfg.block_size), cfg.mask_token_id, np.int32)
        blk[:, 0] = windows[:, a]
        blocks.append(blk)

    def forward(d, contexts, blocks):
        for f, b in zip(contexts, blocks):
            draft_logits(target, d, f, b)

    return collect_linear_inputs(forward, drafter, contexts, blocks, max_rows=max_rows, seed=seed)
