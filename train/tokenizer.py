"""A WordPiece tokenizer as BERT's, trained from a text file.

``python -m train.tokenizer --text=input.txt --vocab_size=8192
--out=tokenizer.json`` trains one offline; the ``masked_text`` loader reads
it from ``config.data.tokenizer``, or trains one from its training split
and saves it there at the first run. Training is not reproducible to the
token: the trainer breaks ties between equally frequent merges in hash
order, which changes from run to run. A saved tokenizer is what makes later
runs, and resumed ones, read the same tokens.
"""

import argparse
from typing import Iterable

import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import trainers

from train import checks

# BERT's special tokens; they take ids 0-4, in this order.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train(lines: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
  """A lower-casing WordPiece tokenizer of at most ``vocab_size`` tokens.

  Raises:
    ValueError: if ``vocab_size`` leaves no room beside the special tokens.
  """
  if not checks.is_int(vocab_size) or vocab_size <= len(SPECIAL_TOKENS):
    raise ValueError(
        f"vocab_size must be an int > {len(SPECIAL_TOKENS)}, got"
        f" {vocab_size!r}"
    )
  tokenizer = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = decoders.WordPiece()
  trainer = trainers.WordPieceTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS),
      show_progress=False,
  )
  tokenizer.train_from_iterator(lines, trainer)
  # The trainer numbers tokens in hash order; numbered in sorted order, the
  # ids are a function of the token set (WordPiece matches by string).
  learned = sorted(set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS))
  tokenizer.model = models.WordPiece(
      {t: i for i, t in enumerate(SPECIAL_TOKENS + tuple(learned))},
      unk_token="[UNK]",
  )
  return tokenizer


def load(path: str) -> tokenizers.Tokenizer:
  """A tokenizer saved by ``python -m train.tokenizer``.

  Raises:
    ValueError: if it cannot be read, or lacks BERT's special tokens at ids
      0-4.
  """
  try:
    tokenizer = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises plain Exception
    raise ValueError(
        f"the tokenizer {path} cannot be read ({e}); delete it to train a"
        " new one from the text, or point config.data.tokenizer at a good"
        " one"
    ) from e
  ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
  if ids != list(range(len(SPECIAL_TOKENS))):
    raise ValueError(
        f"the tokenizer {path} must hold {', '.join(SPECIAL_TOKENS)} at ids"
        f" 0-{len(SPECIAL_TOKENS) - 1}, got ids {ids}"
    )
  return tokenizer


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m train.tokenizer")
  parser.add_argument("--text", required=True, help="UTF-8 text to train on")
  parser.add_argument(
      "--vocab_size", type=int, default=8192, help="tokens at most"
  )
  parser.add_argument("--out", required=True, help="the tokenizer's JSON file")
  args = parser.parse_args(argv)
  with open(args.text, encoding="utf-8") as f:
    tokenizer = train(f, args.vocab_size)
  tokenizer.save(args.out)
  print(f"wrote {args.out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
  main()
