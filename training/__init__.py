"""How the embedded default model (model/default_model/) was made: its tokenizer, its training and its evaluation.
Run from the repository root: ``python -m training.train_default_model OUT_DIR`` (docs in that module)."""
