"""Instruments that measure the core, never imported by it: end-to-end speculative benchmarks (`speculative`),
compile counts (`compile`), meshes (`mesh`), CPU matmuls (`matmul`), the prepared GPU run (`device_report`) and model
quality (`quality`). Run the modules with `python -m dflash_jax.bench.<name>`."""
