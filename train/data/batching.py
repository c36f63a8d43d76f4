"""Deterministic training batches and evaluation passes over a ``Source``."""

from typing import Iterator

import numpy as np

from train import checks
from train.data.sources import Source

# CIFAR-style augmentation, as in the ResNet papers.
_PAD = 4
# Tells the per-example random streams (seed, position, 2) apart from the
# epoch orders (seed, epoch) and the batch augmentations (seed, step, 1).
_EXAMPLE_STREAM = 2


def _check_split(global_batch: int, process_index: int, process_count: int):
  checks.integer("global_batch", global_batch, 1)
  checks.integer("process_count", process_count, 1)
  if not 0 <= process_index < process_count:
    raise ValueError(
        f"process_index={process_index} must lie in [0, {process_count})"
    )
  if global_batch % process_count:
    raise ValueError(
        f"global_batch={global_batch} is not divisible by"
        f" process_count={process_count}"
    )


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
    checks.integer("seed", seed, 0)
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
    checks.integer("step", step, 0)

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
