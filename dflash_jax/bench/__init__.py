"""Instruments that measure the core, never imported by it: end-to-end speculative benchmarks and their tables
(`speculative`), per-step costs (`step_costs`), the llama.cpp NVFP4 bug replayed through a GGUF file (`gguf_replay`),
compile counts (`compile`), meshes (`mesh`), CPU matmuls (`matmul`), the prepared GPU run (`device_report`) and model
quality (`quality`); `command` runs the `dflash-jax bench` modes. Run the modules with
`python -m dflash_jax.bench.<name>`."""
