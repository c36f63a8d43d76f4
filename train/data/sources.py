"""Random access to the examples of a split: the ``Source`` protocol, the
``Dataset`` a loader returns, and one source for each way data is held."""

import dataclasses
from typing import Any, Protocol

import numpy as np

from train import images as images_lib

TASKS = ("classification", "causal_lm", "masked_lm")
# [MASK] in BERT's uncased WordPiece vocabulary, so synthetic masked-LM batches
# look like the ones a BERT model is benchmarked on.
MASK_ID = 103
MASK_RATE = 0.15


class Source(Protocol):
  """Random access to the examples of one split."""

  def __len__(self) -> int:
    ...

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """A batch holding examples ``indices``, rows in the given order.

    ``seeds``, int64 [B, 3], is each row's entropy for
    ``np.random.default_rng``, for sources that draw random crops or masks
    per example; without it such a source draws from the example's index, so
    that evaluation is the same on every pass.
    """
    ...


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A loader's two splits and what a model needs to know about them.

  Attributes:
    train: the training split.
    eval: the evaluation split.
    task: one of ``TASKS``.
    num_classes: classes, or the vocabulary size for language models.
    input_shape: one example's ``inputs``, e.g. (8, 8, 1) or (seq_len,).
  """

  train: Source
  eval: Source
  task: str
  num_classes: int
  input_shape: tuple[int, ...]


def _indices(indices, size: int) -> np.ndarray:
  # Negative indices would silently wrap in the gathers below.
  indices = np.asarray(indices, dtype=np.int64).reshape(-1)
  if indices.size and (indices.min() < 0 or indices.max() >= size):
    raise IndexError(f"indices must lie in [0, {size}), got {indices}")
  return indices


class ImageSource:
  """Labelled images kept as uint8 (a quarter of float32's memory)."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, max_value: float):
    if images.ndim != 4 or len(images) != len(labels):
      raise ValueError(
          f"need images [N, H, W, C] and labels [N], got {images.shape} and"
          f" {labels.shape}"
      )
    self._images = images
    self._labels = labels.astype(np.int32)
    self._max_value = np.float32(max_value)

  def __len__(self) -> int:
    return len(self._images)

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    del seeds  # deterministic
    indices = _indices(indices, len(self))
    return {
        "inputs": self._images[indices].astype(np.float32) / self._max_value,
        "targets": self._labels[indices],
        "weights": np.ones(len(indices), np.float32),
    }


class ArraySource:
  """Examples given as whole arrays, one row per example."""

  def __init__(self, arrays: dict[str, np.ndarray]):
    self._arrays = arrays
    self._size = len(arrays["inputs"])

  def __len__(self) -> int:
    return self._size

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    del seeds  # deterministic
    indices = _indices(indices, len(self))
    return {k: v[indices] for k, v in self._arrays.items()}


class TextSource:
  """Next-character prediction over one long token stream.

  Example i is ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: inputs are its
  first ``seq_len`` tokens and targets its last ``seq_len``. Consecutive
  examples share one token, so every token but the first is a target once.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, vocab: str):
    self._tokens = tokens
    self._seq_len = seq_len
    self._offsets = np.arange(seq_len + 1)
    self.vocab = vocab  # Token i is the character vocab[i].

  def __len__(self) -> int:
    return (len(self._tokens) - 1) // self._seq_len

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    del seeds  # deterministic
    indices = _indices(indices, len(self))
    chunks = self._tokens[indices[:, None] * self._seq_len + self._offsets]
    return {
        "inputs": chunks[:, :-1],
        "targets": chunks[:, 1:],
        "weights": np.ones((len(indices), self._seq_len), np.float32),
    }


class MaskedTextSource:
  """BERT's masked-LM examples over one long token stream.

  Example i is ``tokens[i * seq_len : (i + 1) * seq_len]``. Its targets are
  those tokens; round(15% of seq_len) positions (at least one), drawn from
  the row's seeds, have weight 1, and of them 80% read ``[MASK]`` in the
  inputs, 10% a random non-special token and 10% the token itself.
  """

  def __init__(
      self, tokens: np.ndarray, seq_len: int, vocab_size: int, mask_id: int
  ):
    self._tokens = tokens
    self._seq_len = seq_len
    self._vocab_size = vocab_size
    self._mask_id = mask_id
    self._num_masked = max(1, round(MASK_RATE * seq_len))

  def __len__(self) -> int:
    return len(self._tokens) // self._seq_len

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    indices = _indices(indices, len(self))
    targets = self._tokens[
        indices[:, None] * self._seq_len + np.arange(self._seq_len)
    ]
    inputs = targets.copy()
    weights = np.zeros(targets.shape, np.float32)
    for row, rng in enumerate(_rngs(indices, seeds)):
      chosen = rng.permutation(self._seq_len)[: self._num_masked]
      weights[row, chosen] = 1
      kind = rng.random(len(chosen))
      inputs[row, chosen[kind < 0.8]] = self._mask_id
      randomized = chosen[(kind >= 0.8) & (kind < 0.9)]
      inputs[row, randomized] = rng.integers(
          self._mask_id + 1, self._vocab_size, len(randomized)
      )
    return {"inputs": inputs, "targets": targets, "weights": weights}


def _read(source, keys: list[int]) -> list[Any]:
  if hasattr(source, "__getitems__"):
    # One batched read instead of a file seek per record.
    return source.__getitems__(keys)
  return [source[k] for k in keys]


def _rngs(indices: np.ndarray, seeds: np.ndarray | None):
  """One generator per row, from its seeds or else from its index."""
  if seeds is None:
    return [np.random.default_rng(i) for i in indices.tolist()]
  return [np.random.default_rng(s) for s in seeds.tolist()]


class TfdsSource:
  """A ``tfds.data_source`` split of (image, label) records."""

  def __init__(self, source, image_key: str, label_key: str):
    self._source = source
    self._image_key = image_key
    self._label_key = label_key

  def __len__(self) -> int:
    return len(self._source)

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    indices = _indices(indices, len(self))
    records = _read(self._source, indices.tolist())
    images = [r[self._image_key] for r in records]
    labels = np.array([r[self._label_key] for r in records], np.int32)
    return {
        "inputs": self._inputs(images, indices, seeds),
        "targets": labels.reshape(len(indices)),
        "weights": np.ones(len(indices), np.float32),
    }

  def _inputs(
      self, images: list[Any], indices: np.ndarray, seeds: np.ndarray | None
  ) -> np.ndarray:
    """float32 [B, H, W, C]: the images as they are, uint8 scaled to [0, 1]."""
    del indices, seeds  # deterministic
    images = np.stack([np.asarray(i) for i in images])
    if images.ndim == 3:
      images = images[..., None]
    inputs = images.astype(np.float32)
    if images.dtype == np.uint8:
      inputs /= np.float32(255)
    return inputs


class TfdsImageSource(TfdsSource):
  """A ``tfds.data_source`` split of encoded images of any size, cropped.

  Training crops (``train=True``) are random per row, drawn from the row's
  seeds (``images.train_image``); evaluation crops are central
  (``images.eval_image``).
  """

  def __init__(
      self,
      source,
      image_key: str,
      label_key: str,
      preprocess: images_lib.Preprocess,
      train: bool,
  ):
    # The source reads the images undecoded.
    super().__init__(source, image_key, label_key)
    self._preprocess = preprocess
    self._train = train

  def _inputs(
      self, images: list[Any], indices: np.ndarray, seeds: np.ndarray | None
  ) -> np.ndarray:
    """float32 [B, size, size, 3]: decoded, cropped, normalized."""
    if self._train:
      inputs = [
          images_lib.train_image(e, self._preprocess, rng)
          for e, rng in zip(images, _rngs(indices, seeds))
      ]
    else:
      inputs = [images_lib.eval_image(e, self._preprocess) for e in images]
    size = self._preprocess.image_size
    return np.stack(inputs).reshape(len(indices), size, size, 3)
