"""Host-side data: named loaders, deterministic training batches, eval passes.

Every batch is a dict of NumPy arrays:

* ``inputs``: float32 [B, H, W, C] images, or int32 [B, L] token ids;
* ``targets``: int32 [B] labels, or int32 [B, L] token ids;
* ``weights``: float32 [B] or [B, L]; losses and accuracies are weighted
  means, so padding rows (weight 0) and unmasked tokens do not count.

``build(config.data)`` picks a loader by ``config.data.name`` and returns a
``Dataset`` of two random-access ``Source`` splits. ``Loader.batch(step)`` is a
pure function of (seed, step), so a resumed run continues from the step number
alone; ``eval_batches`` walks a split once, in order.
"""

import dataclasses
import gzip
import math
import os
from typing import Any, Callable, Iterator, Protocol
import zlib

import ml_collections
import numpy as np

from train import images as images_lib

TASKS = ("classification", "causal_lm", "masked_lm")
# [MASK] in BERT's uncased WordPiece vocabulary, so synthetic masked-LM batches
# look like the ones a BERT model is benchmarked on.
MASK_ID = 103
MASK_RATE = 0.15
# CIFAR-style augmentation, as in the ResNet papers.
_PAD = 4
# Tells the per-example random streams (seed, position, 2) apart from the
# epoch orders (seed, epoch) and the batch augmentations (seed, step, 1).
_EXAMPLE_STREAM = 2


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
    del seeds  # deterministic
    keys = _indices(indices, len(self)).tolist()
    records = _read(self._source, keys)
    images = np.stack([np.asarray(r[self._image_key]) for r in records])
    if images.ndim == 3:
      images = images[..., None]
    inputs = images.astype(np.float32)
    if images.dtype == np.uint8:
      inputs /= np.float32(255)
    labels = np.array([r[self._label_key] for r in records], np.int32)
    return {
        "inputs": inputs,
        "targets": labels.reshape(len(keys)),
        "weights": np.ones(len(keys), np.float32),
    }


class TfdsImageSource:
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
    self._source = source  # reads the images undecoded
    self._image_key = image_key
    self._label_key = label_key
    self._preprocess = preprocess
    self._train = train

  def __len__(self) -> int:
    return len(self._source)

  def get(
      self, indices: np.ndarray, seeds: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    indices = _indices(indices, len(self))
    records = _read(self._source, indices.tolist())
    encoded = [r[self._image_key] for r in records]
    if self._train:
      inputs = [
          images_lib.train_image(e, self._preprocess, rng)
          for e, rng in zip(encoded, _rngs(indices, seeds))
      ]
    else:
      inputs = [images_lib.eval_image(e, self._preprocess) for e in encoded]
    size = self._preprocess.image_size
    return {
        "inputs": np.stack(inputs).reshape(len(indices), size, size, 3),
        "targets": (
            np.array([r[self._label_key] for r in records], np.int32).reshape(
                len(indices)
            )
        ),
        "weights": np.ones(len(indices), np.float32),
    }


# How the tfds loader reads images: as they are, or cropped as for ImageNet.
PREPROCESS = ("none", "imagenet")

# Loaders: each takes its config arguments as keywords and returns a Dataset.


def _load_digits() -> Dataset:
  """scikit-learn's 1797 8x8 digits; needs no download.

  The split is fixed, independent of any training seed: after a permutation
  drawn from seed 0, the last ceil(20%) = 360 images are eval and the first
  1437 are train.
  """
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


_IDX_DTYPES = {0x08: np.uint8}
_IMAGES_SUFFIX = "-images-idx3-ubyte"
_LABELS_SUFFIX = "-labels-idx1-ubyte"


def read_idx(path: str, ndim: int) -> np.ndarray:
  """An unsigned-byte IDX array (MNIST's format), gzipped or not.

  The header is two zero bytes, a dtype code (0x08: uint8), the number of
  dimensions, then each dimension as a big-endian uint32.

  Args:
    path: the file; read through gzip when it ends in ``.gz``.
    ndim: the number of dimensions the file must have (3 for images, 1 for
      labels).

  Returns:
    The array, uint8, with the file's shape.

  Raises:
    ValueError: if the header is not that of a uint8 IDX file with ``ndim``
      dimensions, or the data has the wrong length.
  """
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # a damaged gzip stream
    raise ValueError(f"{path} cannot be read: {e}") from None
  if len(data) < 4 or data[:2] != b"\0\0" or data[2] not in _IDX_DTYPES:
    raise ValueError(
        f"{path} is not a uint8 IDX file: magic bytes {data[:4].hex()},"
        f" expected 0000080{ndim}"
    )
  if data[3] != ndim:
    raise ValueError(f"{path} has {data[3]} dimensions, expected {ndim}")
  header = 4 + 4 * ndim
  shape = tuple(int(d) for d in np.frombuffer(data[4:header], ">u4"))
  if len(data) - header != math.prod(shape):
    raise ValueError(
        f"{path} holds {len(data) - header} bytes after its header, expected"
        f" {math.prod(shape)} for shape {shape}"
    )
  return np.frombuffer(data, _IDX_DTYPES[data[2]], offset=header).reshape(shape)


def _idx_file(directory: str, stem: str) -> str | None:
  # Prefer the uncompressed file: it is the one a user unpacked on purpose.
  for name in (stem, stem + ".gz"):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def _load_mnist(path: str, eval_examples: int) -> Dataset:
  """MNIST from IDX files: the last ``eval_examples`` images are eval.

  Every ``PREFIX-images-idx3-ubyte[.gz]`` in ``path`` is read with its
  ``PREFIX-labels-idx1-ubyte[.gz]``, ``train`` files before ``t10k`` files, so
  the full data set with ``eval_examples=10000`` gives the standard split.
  """
  if not os.path.isdir(path):
    raise NotADirectoryError(f"config.data.path={path} is not a directory")
  prefixes = sorted(
      {
          name.split(_IMAGES_SUFFIX)[0]
          for name in os.listdir(path)
          if name.endswith((_IMAGES_SUFFIX, _IMAGES_SUFFIX + ".gz"))
      },
      key=lambda p: (p.startswith("t10k"), p),
  )
  if not prefixes:
    raise FileNotFoundError(
        f"config.data.path={path} holds no *{_IMAGES_SUFFIX}[.gz] file"
    )
  images, labels = [], []
  for prefix in prefixes:
    labels_file = _idx_file(path, prefix + _LABELS_SUFFIX)
    if labels_file is None:
      raise FileNotFoundError(
          f"config.data.path={path} has {prefix}{_IMAGES_SUFFIX} but no"
          f" {prefix}{_LABELS_SUFFIX}[.gz]"
      )
    images_file = _idx_file(path, prefix + _IMAGES_SUFFIX)
    images.append(read_idx(images_file, 3))
    labels.append(read_idx(labels_file, 1))
    if labels[-1].size and labels[-1].max() >= 10:
      # Out-of-range labels would make the loss NaN at the first step.
      raise ValueError(
          f"{labels_file} holds label {labels[-1].max()}; MNIST's classes"
          " are 0-9"
      )
    if len(images[-1]) != len(labels[-1]):
      raise ValueError(
          f"{images_file} has {len(images[-1])} images but {labels_file} has"
          f" {len(labels[-1])} labels"
      )
  images = np.concatenate(images)[..., None]
  labels = np.concatenate(labels)
  if eval_examples >= len(images):
    raise ValueError(
        f"config.data.eval_examples={eval_examples} leaves no training"
        f" examples out of {len(images)}"
    )
  cut = len(images) - eval_examples
  return Dataset(
      train=ImageSource(images[:cut], labels[:cut], 255),
      eval=ImageSource(images[cut:], labels[cut:], 255),
      task="classification",
      num_classes=10,
      input_shape=images.shape[1:],
  )


def _load_text(path: str, seq_len: int) -> Dataset:
  """Characters of a text file: the first 90% train, the last 10% eval.

  The vocabulary is the sorted set of the file's characters, so token ids
  depend on the file alone.
  """
  text = _read_text(path)
  # Code points sort like Python's characters, so the unique code points are
  # the sorted character set.
  codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  vocab, tokens = np.unique(codes, return_inverse=True)
  tokens = tokens.astype(np.int32).reshape(-1)
  cut = int(0.9 * len(tokens))
  chars = "".join(map(chr, vocab))
  splits = {"train": tokens[:cut], "eval": tokens[cut:]}
  for split, split_tokens in splits.items():
    if len(split_tokens) < seq_len + 1:
      raise ValueError(
          f"config.data.seq_len={seq_len} is longer than the {split} split of"
          f" config.data.path={path} ({len(split_tokens)} characters)"
      )
  return Dataset(
      train=TextSource(splits["train"], seq_len, chars),
      eval=TextSource(splits["eval"], seq_len, chars),
      task="causal_lm",
      num_classes=len(vocab),
      input_shape=(seq_len,),
  )


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise ValueError(
        f"{path} is not UTF-8 text (byte {e.start}: {e.reason})"
    ) from None


def _load_masked_text(
    path: str, seq_len: int, vocab_size: int, tokenizer: str
) -> Dataset:
  """BERT's masked LM on a text file: the lines of its first 90% train, the
  rest eval.

  The WordPiece tokenizer is read from ``tokenizer`` (by default
  ``PATH.wordpiece-VOCAB_SIZE.json`` beside the text); when that file does
  not exist, it is trained on the training lines and written there, so that
  later runs and resumed ones tokenize alike. In runs of several processes,
  train it beforehand with ``python -m train.tokenizer``.
  """
  from train import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

  text = _read_text(path)
  cut = text.rfind("\n", 0, int(0.9 * len(text))) + 1
  splits = {"train": text[:cut], "eval": text[cut:]}
  tokenizer = os.path.expanduser(
      tokenizer or f"{path}.wordpiece-{vocab_size}.json"
  )
  if os.path.exists(tokenizer):
    words = tokenizer_lib.load(tokenizer)
  else:
    words = tokenizer_lib.train(splits["train"].splitlines(True), vocab_size)
    partial = f"{tokenizer}.{os.getpid()}.partial"
    words.save(partial)
    os.replace(partial, tokenizer)
  if words.get_vocab_size() != vocab_size:
    raise ValueError(
        f"config.data.tokenizer={tokenizer} holds"
        f" {words.get_vocab_size()} tokens, but config.data.vocab_size is"
        f" {vocab_size}"
    )
  sources = {}
  for split, split_text in splits.items():
    encoded = words.encode_batch(split_text.splitlines(True))
    tokens = np.array([t for e in encoded for t in e.ids], np.int32)
    if len(tokens) < seq_len:
      raise ValueError(
          f"config.data.seq_len={seq_len} is longer than the {split} split of"
          f" config.data.path={path} ({len(tokens)} tokens)"
      )
    sources[split] = MaskedTextSource(
        tokens,
        seq_len,
        vocab_size,
        tokenizer_lib.SPECIAL_TOKENS.index("[MASK]"),
    )
  return Dataset(
      train=sources["train"],
      eval=sources["eval"],
      task="masked_lm",
      num_classes=vocab_size,
      input_shape=(seq_len,),
  )


def _load_tfds(
    tfds_name: str,
    data_dir: str,
    train_split: str,
    eval_split: str,
    image_key: str,
    label_key: str,
    preprocess: str,
    image_size: int,
    crop_scale: tuple[float, float],
    crop_ratio: tuple[float, float],
    crop_fraction: float,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
  """An image classification data set prepared by TFDS as array_record.

  Nothing is downloaded: prepare it first with ``tfds build NAME
  --data_dir=DATA_DIR --file_format=array_record``. Decoding PNG or JPEG
  ``Image`` features needs Pillow or OpenCV.

  ``preprocess="none"`` reads images of one fixed shape as they are, scaled
  to [0, 1]. ``preprocess="imagenet"`` reads images of any size: random
  resized crops and flips for training, central crops for evaluation, both
  ``image_size`` square and normalized by ``mean`` and ``std`` (see
  ``images.Preprocess`` for the other arguments).
  """
  if preprocess not in PREPROCESS:
    raise ValueError(
        f"config.data.preprocess must be one of {list(PREPROCESS)}, got"
        f" {preprocess!r}"
    )
  if preprocess == "imagenet":
    crops = images_lib.Preprocess(
        image_size=image_size,
        crop_scale=crop_scale,
        crop_ratio=crop_ratio,
        crop_fraction=crop_fraction,
        mean=mean,
        std=std,
    )
  # Only this loader needs TFDS, and its import is slow.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  # TFDS's own error for an unprepared data set is about file formats.
  base_name = tfds_name.split(":")[0].split("/")[0]
  if not os.path.isdir(os.path.join(data_dir, base_name)):
    raise FileNotFoundError(
        f"config.data.data_dir={data_dir} holds no prepared {tfds_name!r};"
        f" run `tfds build {tfds_name} --data_dir={data_dir}"
        " --file_format=array_record`"
    )

  def source(split, decoders=None):
    return tfds.data_source(
        tfds_name,
        split=split,
        data_dir=data_dir,
        download=False,
        decoders=decoders,
    )

  features = source(train_split).dataset_info.features
  for field, key in (("image_key", image_key), ("label_key", label_key)):
    if key not in features:
      raise ValueError(
          f"config.data.{field}={key!r} is not a feature of {tfds_name};"
          f" features: {', '.join(features.keys())}"
      )
  num_classes = features[label_key].num_classes
  if preprocess == "imagenet":
    if not isinstance(features[image_key], tfds.features.Image):
      raise ValueError(
          f"config.data.preprocess='imagenet' needs encoded images, but"
          f" {tfds_name}'s {image_key!r} is a {type(features[image_key]).__name__}"
      )
    # The images come as bytes: decoding is part of the preprocessing.
    skip = {image_key: tfds.decode.SkipDecoding()}
    return Dataset(
        train=TfdsImageSource(
            source(train_split, skip), image_key, label_key, crops, True
        ),
        eval=TfdsImageSource(
            source(eval_split, skip), image_key, label_key, crops, False
        ),
        task="classification",
        num_classes=num_classes,
        input_shape=(image_size, image_size, 3),
    )
  shape = tuple(features[image_key].shape)
  if len(shape) == 2:
    shape += (1,)
  if None in shape:
    raise ValueError(
        f"{tfds_name} images have variable shape {shape}; batches need a"
        " fixed one: set config.data.preprocess='imagenet' to crop them to"
        " config.data.image_size"
    )
  return Dataset(
      train=TfdsSource(source(train_split), image_key, label_key),
      eval=TfdsSource(source(eval_split), image_key, label_key),
      task="classification",
      num_classes=num_classes,
      input_shape=shape,
  )


def _load_synthetic_images(
    image_size: int,
    channels: int,
    num_classes: int,
    num_examples: int,
    seed: int,
) -> Dataset:
  """Random images and labels, for throughput runs; nothing to learn.

  Train and eval are two pools of ``num_examples``, drawn from (seed, 0) and
  (seed, 1).
  """

  def pool(split: int) -> ImageSource:
    rng = np.random.default_rng((seed, split))
    shape = (num_examples, image_size, image_size, channels)
    return ImageSource(
        rng.integers(0, 256, shape, dtype=np.uint8),
        rng.integers(0, num_classes, num_examples),
        255,
    )

  return Dataset(
      train=pool(0),
      eval=pool(1),
      task="classification",
      num_classes=num_classes,
      input_shape=(image_size, image_size, channels),
  )


def _load_synthetic_tokens(
    seq_len: int, vocab_size: int, task: str, num_examples: int, seed: int
) -> Dataset:
  """Random token sequences, for throughput runs; nothing to learn.

  ``masked_lm``: in each sequence round(15% of seq_len) positions (at least
  one) hold ``MASK_ID`` in the inputs, weight 1, and the original token as
  target; other tokens never equal ``MASK_ID``. ``causal_lm``: targets are the
  inputs shifted by one. Train and eval are two pools of ``num_examples``,
  drawn from (seed, 0) and (seed, 1).
  """
  if task not in ("masked_lm", "causal_lm"):
    raise ValueError(
        "config.data.task must be 'masked_lm' or 'causal_lm', got" f" {task!r}"
    )
  if task == "masked_lm" and vocab_size <= MASK_ID:
    raise ValueError(
        f"config.data.vocab_size={vocab_size} must exceed the mask id"
        f" {MASK_ID}"
    )

  def pool(split: int) -> ArraySource:
    rng = np.random.default_rng((seed, split))
    if task == "causal_lm":
      tokens = rng.integers(0, vocab_size, (num_examples, seq_len + 1))
      tokens = tokens.astype(np.int32)
      return ArraySource(
          {
              "inputs": tokens[:, :-1],
              "targets": tokens[:, 1:],
              "weights": np.ones((num_examples, seq_len), np.float32),
          }
      )
    # Skip MASK_ID so that only masked positions hold it.
    tokens = rng.integers(0, vocab_size - 1, (num_examples, seq_len))
    tokens = (tokens + (tokens >= MASK_ID)).astype(np.int32)
    num_masked = max(1, round(MASK_RATE * seq_len))
    scores = rng.random((num_examples, seq_len))
    masked_positions = np.argsort(scores, axis=1)[:, :num_masked]
    weights = np.zeros((num_examples, seq_len), np.float32)
    np.put_along_axis(weights, masked_positions, 1.0, axis=1)
    return ArraySource(
        {
            "inputs": np.where(weights > 0, MASK_ID, tokens).astype(np.int32),
            "targets": tokens,
            "weights": weights,
        }
    )

  return Dataset(
      train=pool(0),
      eval=pool(1),
      task=task,
      num_classes=vocab_size,
      input_shape=(seq_len,),
  )


_REQUIRED = object()  # Marks an argument without a default.

# name -> (loader, its arguments with their defaults).
LOADERS: dict[str, tuple[Callable[..., Dataset], dict[str, Any]]] = {
    "digits": (_load_digits, {}),
    "mnist": (_load_mnist, {"path": _REQUIRED, "eval_examples": 2000}),
    "text": (_load_text, {"path": _REQUIRED, "seq_len": 128}),
    "tfds": (
        _load_tfds,
        {
            "tfds_name": _REQUIRED,
            "data_dir": _REQUIRED,
            "train_split": "train",
            "eval_split": "test",
            "image_key": "image",
            "label_key": "label",
            "preprocess": "none",
            "image_size": 224,
            "crop_scale": (0.08, 1.0),
            "crop_ratio": (3 / 4, 4 / 3),
            "crop_fraction": 0.875,
            "mean": images_lib.IMAGENET_MEAN,
            "std": images_lib.IMAGENET_STD,
        },
    ),
    "masked_text": (
        _load_masked_text,
        {
            "path": _REQUIRED,
            "seq_len": 128,
            "vocab_size": 8192,
            "tokenizer": "",
        },
    ),
    "synthetic_images": (
        _load_synthetic_images,
        {
            "image_size": 224,
            "channels": 3,
            "num_classes": 1000,
            "num_examples": 256,
            "seed": 0,
        },
    ),
    "synthetic_tokens": (
        _load_synthetic_tokens,
        {
            "seq_len": 64,
            "vocab_size": 30522,
            "task": "masked_lm",
            "num_examples": 256,
            "seed": 0,
        },
    ),
}
_PATH_ARGS = ("path", "data_dir")
# loader -> where its data comes from, for the error when a config's path is
# left empty: the data sets are not part of the repository.
DATA_SOURCES = {
    "mnist": (
        "a folder of MNIST's IDX files (e.g. t10k-images-idx3-ubyte.gz and"
        " t10k-labels-idx1-ubyte.gz from https://yann.lecun.com/exdb/mnist/"
        " or a mirror such as https://ossci-datasets.s3.amazonaws.com/mnist/)"
    ),
    "text": (
        "a UTF-8 text file, e.g. tiny-shakespeare's input.txt from"
        " https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
        "tinyshakespeare/input.txt"
    ),
}
DATA_SOURCES["masked_text"] = DATA_SOURCES["text"]
# Int arguments, checked before loading so a typo fails fast.
_POSITIVE_ARGS = (
    "seq_len",
    "image_size",
    "channels",
    "num_classes",
    "num_examples",
    "vocab_size",
)
_NON_NEGATIVE_ARGS = ("eval_examples", "seed")


def _check_int(key: str, value, minimum: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(
        f"config.data.{key} must be an int >= {minimum}, got {value!r}"
    )


def build(config: ml_collections.ConfigDict) -> Dataset:
  """The data set ``config.name`` made with the arguments beside the name.

  Names, arguments and paths are checked before anything is read.

  Args:
    config: ``config.data`` of a training config, e.g. ``{"name": "mnist",
      "path": "/data/mnist"}``; missing optional arguments take the defaults
      in ``LOADERS``.

  Returns:
    The ``Dataset``.

  Raises:
    ValueError: for an unknown loader name, an argument no loader takes, a
      missing required argument, or a bad value.
    FileNotFoundError: when a path argument does not exist.
  """
  args = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  name = args.pop("name", None)
  if name not in LOADERS:
    raise ValueError(
        f"config.data.name={name!r} is not a loader; choose one of"
        f" {', '.join(LOADERS)}"
    )
  load, params = LOADERS[name]
  # Arguments of other loaders are ignored, so one override of the name
  # switches a config to, say, synthetic data of the same shapes.
  every = set().union(*(p for _, p in LOADERS.values()))
  unknown = sorted(set(args) - every)
  if unknown:
    raise ValueError(
        f"unknown argument(s) {', '.join(f'config.data.{k}' for k in unknown)}"
        f"; loaders take: {', '.join(sorted(every))}"
    )
  args = {k: v for k, v in args.items() if k in params}
  kwargs = {**params, **args}
  # An empty path is a config's placeholder for data it does not bundle.
  missing = [
      k
      for k, v in kwargs.items()
      if v is _REQUIRED or (k in _PATH_ARGS and v == "")
  ]
  if missing:
    where = f": {DATA_SOURCES[name]}" if name in DATA_SOURCES else ""
    raise ValueError(
        f"loader {name!r} needs"
        f" {', '.join(f'config.data.{k}' for k in missing)}{where}"
    )
  for key in _POSITIVE_ARGS:
    if key in kwargs:
      _check_int(key, kwargs[key], 1)
  for key in _NON_NEGATIVE_ARGS:
    if key in kwargs:
      _check_int(key, kwargs[key], 0)
  for key in _PATH_ARGS:
    if key in kwargs:
      kwargs[key] = os.path.expanduser(os.fspath(kwargs[key]))
      if not os.path.exists(kwargs[key]):
        raise FileNotFoundError(
            f"config.data.{key}={kwargs[key]} does not exist"
        )
  return load(**kwargs)


def _check_split(global_batch: int, process_index: int, process_count: int):
  _check_positive("global_batch", global_batch)
  _check_positive("process_count", process_count)
  if not 0 <= process_index < process_count:
    raise ValueError(
        f"process_index={process_index} must lie in [0, {process_count})"
    )
  if global_batch % process_count:
    raise ValueError(
        f"global_batch={global_batch} is not divisible by"
        f" process_count={process_count}"
    )


def _check_positive(name: str, value) -> None:
  if not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def _augment(
    inputs: np.ndarray, flip: np.ndarray, dy: np.ndarray, dx: np.ndarray
) -> np.ndarray:
  """Pads rows by 4 zero pixels, crops at (dy, dx), flips rows where flip."""
  b, h, w, _ = inputs.shape
  padded = np.pad(inputs, ((0, 0), (_PAD, _PAD), (_PAD, _PAD), (0, 0)))
  rows = dy[:, None] + np.arange(h)
  # Reading the crop's columns backwards flips it in the same gather.
  cols = np.where(flip[:, None], np.arange(w)[::-1], np.arange(w)) + dx[:, None]
  return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


class Loader:
  """Deterministic batches: batch `step` is a pure function of (seed, step).

  The data position thus survives a resume as the step number alone.

  The global example stream is epoch 0, epoch 1, ... back to back, epoch e
  being a permutation of the split drawn from ``default_rng((seed, e))`` (the
  identity with ``shuffle=False``). Global batch ``step`` is
  ``stream[step * global_batch : (step + 1) * global_batch]``: batches span
  epoch boundaries, so no example is dropped. Each process reads only its
  contiguous ``global_batch / process_count`` rows of it. The example at
  stream position p gets seeds (seed, p, 2) for its random crop or mask.
  """

  def __init__(
      self,
      source: Source,
      *,
      global_batch: int,
      seed: int,
      process_index: int = 0,
      process_count: int = 1,
      shuffle: bool = True,
      augment: bool = False,
  ):
    """Checks the arguments.

    Args:
      source: the split to read.
      global_batch: examples per step over all processes.
      seed: a non-negative int; selects the epochs' orders and augmentations.
      process_index: which process this is, in [0, process_count).
      process_count: the number of processes that share each global batch.
      shuffle: permute each epoch; otherwise read the split in order.
      augment: flip and pad-and-crop images (classification only).

    Raises:
      ValueError: on an empty source, a non-positive batch, a batch that does
        not split evenly over the processes, a negative seed, or
        ``augment`` on non-image data.
    """
    _check_split(global_batch, process_index, process_count)
    if not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not len(source):
      raise ValueError("the source holds no examples")
    if augment:
      inputs = source.get(np.zeros(1, np.int64))["inputs"]
      if inputs.ndim != 4 or inputs.dtype != np.float32:
        raise ValueError(
            "augment=True needs float32 images [B, H, W, C], got inputs of"
            f" shape {inputs.shape[1:]} and dtype {inputs.dtype}"
        )
    self._source = source
    self._size = len(source)
    self._global_batch = global_batch
    self._local_batch = global_batch // process_count
    self._process_index = process_index
    self._seed = seed
    self._shuffle = shuffle
    self._augment = augment
    # The last epoch orders used; a batch touches at most a few epochs.
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      if len(self._orders) >= 2:
        del self._orders[min(self._orders)]
      if self._shuffle:
        rng = np.random.default_rng((self._seed, epoch))
        self._orders[epoch] = rng.permutation(self._size)
      else:
        self._orders[epoch] = np.arange(self._size)
    return self._orders[epoch]

  def _check_step(self, step: int) -> None:
    if not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch ``step``."""
    self._check_step(step)
    first = step * self._global_batch + self._process_index * self._local_batch
    positions = np.arange(first, first + self._local_batch)
    epochs, offsets = np.divmod(positions, self._size)
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
      rows = epochs == epoch
      indices[rows] = self._order(int(epoch))[offsets[rows]]
    # A row's random crop or mask depends on its place in the stream alone,
    # not on which process or worker reads it.
    seeds = np.stack(
        np.broadcast_arrays(self._seed, positions, _EXAMPLE_STREAM), axis=1
    )
    batch = self._source.get(indices, seeds)
    if self._augment:
      # Drawn for the whole global batch, then sliced, so that the processes'
      # rows together equal the single-process batch.
      rng = np.random.default_rng((self._seed, step, 1))
      flip = rng.random(self._global_batch) < 0.5
      dy, dx = rng.integers(0, 2 * _PAD + 1, (2, self._global_batch))
      start = self._process_index * self._local_batch
      rows = slice(start, start + self._local_batch)
      batch["inputs"] = _augment(
          batch["inputs"], flip[rows], dy[rows], dx[rows]
      )
    return batch

  def position(self, step: int) -> dict[str, int]:
    """``{"epoch": e, "index": i}``: where global batch ``step`` starts."""
    self._check_step(step)
    epoch, index = divmod(step * self._global_batch, self._size)
    return {"epoch": int(epoch), "index": int(index)}


def num_eval_batches(source: Source, global_batch: int) -> int:
  """How many global batches of ``global_batch`` cover ``source`` once."""
  return -(-len(source) // global_batch)


def eval_batch(
    source: Source,
    number: int,
    *,
    global_batch: int,
    process_index: int = 0,
    process_count: int = 1,
) -> dict[str, np.ndarray]:
  """This process's rows of evaluation batch ``number`` (see
  ``eval_batches``)."""
  local_batch = global_batch // process_count
  start = number * global_batch
  positions = start + process_index * local_batch + np.arange(local_batch)
  valid = positions < len(source)
  batch = source.get(np.where(valid, positions, start))
  weights = batch["weights"]
  mask = valid.reshape((-1,) + (1,) * (weights.ndim - 1))
  batch["weights"] = np.where(mask, weights, 0).astype(np.float32)
  return batch


def eval_batches(
    source: Source,
    *,
    global_batch: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
  """The whole split once, in order, in global batches of ``global_batch``.

  The last batch is padded to full size with copies of its row 0 at weight 0,
  so every batch has one shape (one compilation) and weighted means count
  each example once. Every process yields the same number of batches, each
  with its contiguous ``global_batch / process_count`` rows.

  Raises:
    ValueError: if ``global_batch`` does not split evenly over the processes.
  """
  _check_split(global_batch, process_index, process_count)
  for number in range(num_eval_batches(source, global_batch)):
    yield eval_batch(
        source,
        number,
        global_batch=global_batch,
        process_index=process_index,
        process_count=process_count,
    )
