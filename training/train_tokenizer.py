"""The default model's tokenizer: byte-level BPE (any text encodes, no unknown token) trained with the
``tokenizers`` library on the training files (never the held-out ones), with the chat special tokens and template.

``python -m training.train_tokenizer OUT_DIR [--vocab-size 8192]`` writes tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from model.tiny import train_bpe
from training.corpus import EOT, SPECIAL_TOKENS, split, stdlib_files


def train_tokenizer(texts: list[str], vocab_size: int):
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` (the trainer is deterministic for a fixed input order)."""
    # the model's own length limit is in config.json; pairs seen once are not merged
    return train_bpe(texts, vocab_size, SPECIAL_TOKENS, EOT, min_frequency=2, model_max_length=1 << 30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("out_dir", type=Path, help="where tokenizer.json and tokenizer_config.json are written")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary, special tokens included")
    args = p.parse_args(argv)
    train, _ = split(stdlib_files())
    tokenizer = train_tokenizer([text for _, text in train], args.vocab_size)
    tokenizer.save_pretrained(args.out_dir)
    print(f"tokenizer: {len(tokenizer)} tokens -> {args.out_dir}")


if __name__ == "__main__":
    main()
