"""Reading and writing models: HF / z-lab / ModelOpt folders and orbax (`checkpoint`), safetensors, the tokenizer,
the shipped default models (`shipped`) and the persistent compilation cache."""
