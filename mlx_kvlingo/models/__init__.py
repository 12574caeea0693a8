"""Models and files: the pair (loading through mlx-lm, tokenizer check), model families,
translator files, the Hub, model cards and the demo pairs."""
