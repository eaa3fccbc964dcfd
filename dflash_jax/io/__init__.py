"""Reading and writing models: what a path is (`model_path`), the loaders (`checkpoint`), HF / z-lab / ModelOpt
folders (`hf_folder`, configs in `hf_config` / `zlab_config`), orbax folders (`orbax_folder`), GGUF files (`gguf`,
`gguf_model`, `gguf_drafter`, configs in `gguf_config`), safetensors, the tokenizers, the shipped default models
(`shipped`), the file audit and the persistent compilation cache."""
