"""Batches read ahead in worker processes, on grain.

A pipeline is a random-access grain ``MapDataset`` over batch numbers mapped
through a pure function ``read(number) -> batch`` (``Loader.batch`` for
training, ``data.eval_batch`` for evaluation). Worker processes each compute
whole batches, and grain hands them back in the order of their numbers, so
the batches are the same with any number of workers, and a resumed run
starts the range at its step.
"""

import contextlib
import signal
from typing import Callable, Iterator

from absl import flags
import grain
import numpy as np

from train import checks


def _leave_signals_to_the_trainer(worker: int, workers: int) -> None:
  """Run in each worker process first: Ctrl-C and a closed terminal reach
  the whole process group, and the trainer, which saves a checkpoint and
  then ends the workers, is the one to act on them (a worker would print
  its own ``KeyboardInterrupt`` and leave its shared memory behind)."""
  del worker, workers
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)


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
  try:
    yield iterator
  finally:
    iterator.close()
