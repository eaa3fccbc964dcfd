"""Training utilities: stdlib corpus, tokenizer training, and (elsewhere) LM/drafter training."""
