"""Batches read ahead in worker processes, on grain.

A pipeline is a random-access grain ``MapDataset`` over batch numbers mapped
through a pure function ``read(number) -> batch`` (``Loader.batch`` for
training, ``data.eval_batch`` for evaluation). Worker processes each compute
whole batches, and grain hands them back in the order of their numbers, so
the batches are the same with any number of workers, and a resumed run
starts the range at its step.
"""

import contextlib
import gc
import itertools
import signal
from typing import Any, Callable, Iterator

from absl import flags
import grain
import numpy as np

from train import checks


# Ctrl-C and a closed terminal reach the whole process group, and the
# trainer, which saves a checkpoint and then ends the workers, is the one to
# act on them: a worker would print its own ``KeyboardInterrupt`` and leave
# its shared memory behind.
_TRAINERS_SIGNALS = {signal.SIGINT, signal.SIGHUP}


def _leave_signals_to_the_trainer(worker: int, workers: int) -> None:
  """Run in each worker process first: it ignores the trainer's signals
  (those that came while it started, held until now, are dropped)."""
  del worker, workers
  for signum in _TRAINERS_SIGNALS:
    signal.signal(signum, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _TRAINERS_SIGNALS)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
  """Holds the trainer's signals in this thread: the threads and worker
  processes grain starts meanwhile inherit the mask, so a worker cannot be
  interrupted while it imports its modules, before it ignores the signals;
  the trainer's own handler runs once they are released."""
  held = signal.pthread_sigmask(signal.SIG_BLOCK, _TRAINERS_SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _Reader:
  """The batches of a grain iterator. Closed, it closes the iterator and
  lets go of it; with worker processes, it also collects the batches they
  left in shared memory now, not at the interpreter's exit, where grain's
  finalisers fail."""

  def __init__(self, iterator: Any, workers: int):
    self._iterator = iterator
    self._workers = workers
    self._ahead = []

  def start(self) -> None:
    """With workers, reads the first batch, which starts grain's threads
    and workers, with the trainer's signals held."""
    if not self._workers:
      return
    with _signals_held():
      self._ahead = list(itertools.islice(self._iterator, 1))

  def __iter__(self) -> "_Reader":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._ahead:
      return self._ahead.pop()
    if self._iterator is None:
      raise StopIteration
    return next(self._iterator)

  def close(self) -> None:
    if self._iterator is not None:
      self._iterator.close()
      self._iterator, self._ahead = None, []
      if self._workers:
        gc.collect()


def check(workers: int, prefetch: int) -> None:
  """Raises ``ValueError`` naming a bad ``data_workers`` or ``data_prefetch``."""
  checks.integer("config.data_workers", workers, 0)
  checks.integer("config.data_prefetch", prefetch, 0)
  if workers and not prefetch:
    raise ValueError(
        f"config.data_workers={workers} needs config.data_prefetch >= 1"
    )


@contextlib.contextmanager
def batches(
    read: Callable[[int], dict[str, np.ndarray]],
    start: int,
    stop: int,
    *,
    workers: int,
    prefetch: int,
) -> Iterator[Iterator[dict[str, np.ndarray]]]:
  """Yields an iterator over ``read(start), ..., read(stop - 1)``.

  Args:
    read: a pure function of the batch number; with workers, it is pickled
      into each worker process (started with "spawn"), so it must be a
      module-level function or a bound method of a picklable object.
    start: the first batch number.
    stop: one past the last.
    workers: processes computing batches; 0 computes each batch in this
      process when it is asked for.
    prefetch: batches each worker keeps ready ahead of the training loop.

  The worker processes end when the ``with`` block exits, normally or by an
  exception.
  """
  check(workers, prefetch)
  if not flags.FLAGS.is_parsed():
    # Grain reads its options from absl flags; outside an absl app (a test,
    # a notebook) they take their defaults.
    flags.FLAGS.mark_as_parsed()
  dataset = grain.MapDataset.range(start, stop).map(read)
  if workers == 0:
    iterator = iter(
        dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
    )
  else:
    # One thread per worker: a batch is decoded by the process that owns it.
    iterator = iter(
        dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
        ).mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=workers, per_worker_buffer_size=prefetch
            ),
            worker_init_fn=_leave_signals_to_the_trainer,
        )
    )
  reader = _Reader(iterator, workers)
  try:
    reader.start()
    yield reader
  finally:
    reader.close()
