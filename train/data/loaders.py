"""The loaders of files and of synthetic data, one dataclass each.

A loader's fields are its ``config.data`` arguments (see ``arguments``);
``load()`` reads the data and returns a ``Dataset``.
"""

import dataclasses
import math
import os

import numpy as np

from train import images as images_lib
from train.data import arguments
from train.data import idx
from train.data.sources import ArraySource
from train.data.sources import Dataset
from train.data.sources import ImageSource
from train.data.sources import MASK_ID
from train.data.sources import MASK_RATE
from train.data.sources import MaskedTextSource
from train.data.sources import TextSource


@dataclasses.dataclass(frozen=True)
class Digits:
  """scikit-learn's 1797 8x8 digits; needs no download.

  The split is fixed, independent of any training seed: after a permutation
  drawn from seed 0, the last ceil(20%) = 360 images are eval and the first
  1437 are train.
  """

  def load(self) -> Dataset:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top

    digits = datasets.load_digits()
    images = digits.images.astype(np.uint8)[..., None]  # Values 0..16.
    labels = digits.target
    order = np.random.default_rng(0).permutation(len(images))
    num_eval = math.ceil(0.2 * len(images))
    train, eval_ = order[:-num_eval], order[-num_eval:]
    return Dataset(
        train=ImageSource(images[train], labels[train], 16),
        eval=ImageSource(images[eval_], labels[eval_], 16),
        task="classification",
        num_classes=10,
        input_shape=(8, 8, 1),
    )


@dataclasses.dataclass(frozen=True)
class Mnist:
  """MNIST from IDX files (``idx.read_mnist``): the last ``eval_examples``
  images are eval, so the full data set with ``eval_examples=10000`` gives
  the standard split.

  Attributes:
    path: a folder of IDX files.
    eval_examples: how many of the last images are held out.
  """

  path: str = arguments.path()
  eval_examples: int = arguments.non_negative(2000)

  def load(self) -> Dataset:
    images, labels = idx.read_mnist(self.path)
    if self.eval_examples >= len(images):
      raise ValueError(
          f"config.data.eval_examples={self.eval_examples} leaves no training"
          f" examples out of {len(images)}"
      )
    cut = len(images) - self.eval_examples
    return Dataset(
        train=ImageSource(images[:cut], labels[:cut], 255),
        eval=ImageSource(images[cut:], labels[cut:], 255),
        task="classification",
        num_classes=10,
        input_shape=images.shape[1:],
    )


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise ValueError(
        f"{path} is not UTF-8 text (byte {e.start}: {e.reason})"
    ) from None


def _too_short(seq_len: int, split: str, path: str, length: str) -> str:
  return (
      f"config.data.seq_len={seq_len} is longer than the {split} split of"
      f" config.data.path={path} ({length})"
  )


@dataclasses.dataclass(frozen=True)
class Text:
  """Characters of a text file: the first 90% train, the last 10% eval.

  The vocabulary is the sorted set of the file's characters, so token ids
  depend on the file alone.

  Attributes:
    path: a UTF-8 text file.
    seq_len: characters an example reads.
  """

  path: str = arguments.path()
  seq_len: int = arguments.positive(128)

  def load(self) -> Dataset:
    text = _read_text(self.path)
    # Code points sort like Python's characters, so the unique code points
    # are the sorted character set.
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    vocab, tokens = np.unique(codes, return_inverse=True)
    tokens = tokens.astype(np.int32).reshape(-1)
    cut = int(0.9 * len(tokens))
    chars = "".join(map(chr, vocab))
    splits = {"train": tokens[:cut], "eval": tokens[cut:]}
    for split, split_tokens in splits.items():
      if len(split_tokens) < self.seq_len + 1:
        raise ValueError(
            _too_short(
                self.seq_len,
                split,
                self.path,
                f"{len(split_tokens)} characters",
            )
        )
    return Dataset(
        train=TextSource(splits["train"], self.seq_len, chars),
        eval=TextSource(splits["eval"], self.seq_len, chars),
        task="causal_lm",
        num_classes=len(vocab),
        input_shape=(self.seq_len,),
    )


@dataclasses.dataclass(frozen=True)
class MaskedText:
  """BERT's masked LM on a text file: the lines of its first 90% train, the
  rest eval.

  The WordPiece tokenizer is read from ``tokenizer`` (by default
  ``PATH.wordpiece-VOCAB_SIZE.json`` beside the text); when that file does
  not exist, it is trained on the training lines and written there, so that
  later runs and resumed ones tokenize alike. In runs of several processes,
  train it beforehand with ``python -m train.tokenizer``.

  Attributes:
    path: a UTF-8 text file.
    seq_len: tokens an example holds.
    vocab_size: WordPiece tokens, the special ones included.
    tokenizer: the tokenizer's JSON file; "" for the default beside ``path``.
  """

  path: str = arguments.path()
  seq_len: int = arguments.positive(128)
  vocab_size: int = arguments.positive(8192)
  tokenizer: str = ""

  def load(self) -> Dataset:
    from train import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

    text = _read_text(self.path)
    cut = text.rfind("\n", 0, int(0.9 * len(text))) + 1
    splits = {"train": text[:cut], "eval": text[cut:]}
    words = self._wordpiece(splits["train"])
    mask_id = tokenizer_lib.SPECIAL_TOKENS.index("[MASK]")
    sources = {}
    for split, split_text in splits.items():
      encoded = words.encode_batch(split_text.splitlines(True))
      tokens = np.array([t for e in encoded for t in e.ids], np.int32)
      if len(tokens) < self.seq_len:
        raise ValueError(
            _too_short(self.seq_len, split, self.path, f"{len(tokens)} tokens")
        )
      sources[split] = MaskedTextSource(
          tokens, self.seq_len, self.vocab_size, mask_id
      )
    return Dataset(
        train=sources["train"],
        eval=sources["eval"],
        task="masked_lm",
        num_classes=self.vocab_size,
        input_shape=(self.seq_len,),
    )

  def _wordpiece(self, train_text: str):
    """The tokenizer file's tokenizer, trained on ``train_text`` and written
    there first when the file does not exist."""
    from train import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

    path = os.path.expanduser(
        self.tokenizer or f"{self.path}.wordpiece-{self.vocab_size}.json"
    )
    if os.path.exists(path):
      words = tokenizer_lib.load(path)
    else:
      words = tokenizer_lib.train(train_text.splitlines(True), self.vocab_size)
      partial = f"{path}.{os.getpid()}.partial"
      words.save(partial)
      os.replace(partial, path)
    if words.get_vocab_size() != self.vocab_size:
      raise ValueError(
          f"config.data.tokenizer={path} holds"
          f" {words.get_vocab_size()} tokens, but config.data.vocab_size is"
          f" {self.vocab_size}"
      )
    return words


@dataclasses.dataclass(frozen=True)
class SyntheticImages:
  """Random images and labels, for throughput runs; nothing to learn.

  Train and eval are two pools of ``num_examples``, drawn from (seed, 0) and
  (seed, 1).

  Attributes:
    image_size: the images' side; ImageNet crops' by default.
    channels: channels per pixel.
    num_classes: labels are drawn from [0, num_classes).
    num_examples: images in each split.
    seed: selects the pools.
  """

  image_size: int = arguments.positive(images_lib.Preprocess.image_size)
  channels: int = arguments.positive(3)
  num_classes: int = arguments.positive(1000)
  num_examples: int = arguments.positive(256)
  seed: int = arguments.non_negative(0)

  def load(self) -> Dataset:
    shape = (self.num_examples, self.image_size, self.image_size, self.channels)

    def pool(split: int) -> ImageSource:
      rng = np.random.default_rng((self.seed, split))
      return ImageSource(
          rng.integers(0, 256, shape, dtype=np.uint8),
          rng.integers(0, self.num_classes, self.num_examples),
          255,
      )

    return Dataset(
        train=pool(0),
        eval=pool(1),
        task="classification",
        num_classes=self.num_classes,
        input_shape=shape[1:],
    )


@dataclasses.dataclass(frozen=True)
class SyntheticTokens:
  """Random token sequences, for throughput runs; nothing to learn.

  ``masked_lm``: in each sequence round(15% of seq_len) positions (at least
  one) hold ``MASK_ID`` in the inputs, weight 1, and the original token as
  target; other tokens never equal ``MASK_ID``. ``causal_lm``: targets are the
  inputs shifted by one. Train and eval are two pools of ``num_examples``,
  drawn from (seed, 0) and (seed, 1).

  Attributes:
    seq_len: tokens an example's inputs hold.
    vocab_size: tokens are drawn from [0, vocab_size).
    task: "masked_lm" or "causal_lm".
    num_examples: sequences in each split.
    seed: selects the pools.
  """

  seq_len: int = arguments.positive(64)
  vocab_size: int = arguments.positive(30522)
  task: str = "masked_lm"
  num_examples: int = arguments.positive(256)
  seed: int = arguments.non_negative(0)

  def load(self) -> Dataset:
    if self.task not in ("masked_lm", "causal_lm"):
      raise ValueError(
          "config.data.task must be 'masked_lm' or 'causal_lm', got"
          f" {self.task!r}"
      )
    if self.task == "masked_lm" and self.vocab_size <= MASK_ID:
      raise ValueError(
          f"config.data.vocab_size={self.vocab_size} must exceed the mask id"
          f" {MASK_ID}"
      )
    pool = self._causal if self.task == "causal_lm" else self._masked
    return Dataset(
        train=pool(np.random.default_rng((self.seed, 0))),
        eval=pool(np.random.default_rng((self.seed, 1))),
        task=self.task,
        num_classes=self.vocab_size,
        input_shape=(self.seq_len,),
    )

  def _causal(self, rng: np.random.Generator) -> ArraySource:
    shape = (self.num_examples, self.seq_len + 1)
    tokens = rng.integers(0, self.vocab_size, shape).astype(np.int32)
    return ArraySource(
        {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": np.ones((self.num_examples, self.seq_len), np.float32),
        }
    )

  def _masked(self, rng: np.random.Generator) -> ArraySource:
    shape = (self.num_examples, self.seq_len)
    # Skip MASK_ID so that only masked positions hold it.
    tokens = rng.integers(0, self.vocab_size - 1, shape)
    tokens = (tokens + (tokens >= MASK_ID)).astype(np.int32)
    num_masked = max(1, round(MASK_RATE * self.seq_len))
    scores = rng.random(shape)
    masked_positions = np.argsort(scores, axis=1)[:, :num_masked]
    weights = np.zeros(shape, np.float32)
    np.put_along_axis(weights, masked_positions, 1.0, axis=1)
    return ArraySource(
        {
            "inputs": np.where(weights > 0, MASK_ID, tokens).astype(np.int32),
            "targets": tokens,
            "weights": weights,
        }
    )
