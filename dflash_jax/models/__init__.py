"""The models as pure functions over registered-dataclass weights: attention, layers, the target (Qwen3 family),
the DFlash drafter and DFlash2's block convolution and candidate selector."""
