"""Verified orbax checkpoints of the whole training state.

A checkpoint holds the train state (params, batch statistics, the
compressor's state with every device's residuals but its factors once, the
optimizer's state, the step and the RNG key) and a JSON record: what the
caller passes (step, data position), the run it belongs to, and a checksum of
every array. Orbax writes each to a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint as the latest.

``Checkpointer.restore_latest`` resumes from the newest checkpoint that
verifies. One saved by another run (another compressor, model or device
count) is refused before any array is read; one whose files cannot be read
or whose arrays no longer match their checksums is set aside with a warning,
and the next older one is tried. The restore target comes from
``acp_jax.checkpoint.target``: ACP-SGD's phase from the checkpoint,
everything else checked against the live state.
"""

import json
import os
import time
from typing import Any

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from acp_jax import checkpoint as acp_checkpoint

# Keys the Checkpointer adds to each record.
_RESERVED = ("run", "checksums")


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 in which every input bit
  flips each output bit with probability about 1/2."""
  h ^= h >> 16
  h *= jnp.uint32(0x85EBCA6B)
  h ^= h >> 13
  h *= jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _checksum(x: jax.Array) -> jax.Array:
  """A uint32 checksum of ``x``'s bits: sum over elements of
  fmix32(word ^ fmix32(flat index)), modulo 2**32.

  Each term is a bijection of its word, so changing any one element always
  changes the sum; changing several, or moving an element, leaves it
  unchanged with probability about 2**-32. The flat index comes from iotas
  rather than a reshape, so a sharded array is summed where it lies and only
  the partial sums travel.
  """
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    # 8-byte elements become two words along a new last axis.
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  index = jnp.zeros(words.shape, jnp.uint32)
  for axis, size in enumerate(words.shape):
    index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(
        jnp.uint32, words.shape, axis
    )
  return jnp.sum(_fmix32(words ^ _fmix32(index)), dtype=jnp.uint32)


@jax.jit
def _checksum_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_checksum(x) for x in leaves]


def checksums(tree: Any) -> dict[str, int]:
  """A checksum of each array of ``tree``, keyed by its path.

  Computed on the arrays' devices in one compiled call; each checksum is a
  replicated scalar, so every process of a multi-process run gets the same
  values without any array being gathered.

  Args:
    tree: a pytree of ``jax.Array`` (sharded or not, addressable or not).

  Returns:
    ``{jax.tree_util.keystr(path): checksum}`` with checksums in
    ``[0, 2**32)``: equal for equal arrays, different with probability
    about ``1 - 2**-32`` when any byte differs or elements trade places.
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_checksum_leaves([x for _, x in leaves]))
  return {
      jax.tree_util.keystr(path): int(s)
      for (path, _), s in zip(leaves, sums)
  }


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts as ``{"a.b": leaf}``; empty dicts add nothing."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
  return flat


class _Damaged(Exception):
  """A checkpoint that cannot be used; its message says why."""


class Checkpointer:
  """Saves verified checkpoints of one run, keeps the last ``keep``.

  Args:
    directory: where the checkpoints go, one subdirectory per step.
    keep: how many of the newest checkpoints to keep (0: all of them).
    run: what a checkpoint must share with this run to be resumed by it
      (compressor, model, device count, the params' shapes...), as
      JSON-serializable nested dicts: saved in every record, compared on
      restore.
  """

  def __init__(self, directory: str, *, keep: int, run: dict[str, Any]):
    if not isinstance(keep, int) or keep < 0:
      raise ValueError(f"keep must be a non-negative int, got {keep!r}")
    try:
      # Round-tripped so that it compares equal to what a record holds
      # (tuples come back as lists).
      self._run = json.loads(json.dumps(run))
    except TypeError as e:
      raise ValueError(
          f"run must be JSON-serializable, got {run!r}: {e}"
      ) from e
    self._keep = keep
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            # Old checkpoints are deleted here, once the new one is complete
            # on disk, not by orbax's own count.
            max_to_keep=None,
            # Saving synchronously keeps one code path on every platform; a
            # save costs a fraction of a step here.
            enable_async_checkpointing=False,
        ),
    )

  def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
    """Writes ``state`` and ``record`` (with the run and checksums added) as
    checkpoint ``step``, then deletes all but the newest ``keep``."""
    if reserved := sorted(set(_RESERVED) & set(record)):
      raise ValueError(
          f"record must not hold {reserved}: the Checkpointer writes them"
      )
    self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            record=ocp.args.JsonSave(
                {**record, "run": self._run, "checksums": checksums(state)}
            ),
        ),
    )
    self._manager.wait_until_finished()
    if self._keep:
      for old in sorted(self._manager.all_steps())[: -self._keep]:
        self._manager.delete(old)

  def restore_latest(self, like: Any) -> tuple[Any, dict[str, Any]] | None:
    """The newest checkpoint that verifies, laid out like ``like``.

    Checkpoints whose files cannot be read or whose checksums differ are
    skipped with a warning; when an older one verifies, the skipped ones are
    renamed ``STEP.damaged-TIME`` (kept for inspection, out of the way of
    the steps this run will save again).

    Args:
      like: the live state, e.g. freshly initialized: its structure, shapes,
        dtypes and shardings are what the restore produces (see
        ``acp_jax.checkpoint.target``).

    Returns:
      ``(state, record)`` with the record as passed to ``save``, or None if
      the directory holds no checkpoint.

    Raises:
      ValueError: if a checkpoint was saved by another run (each differing
        key of ``run`` named with both values); nothing is read from it.
      RuntimeError: if there are checkpoints but none of them verifies.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    damaged = []
    for step in steps:
      path = self._manager.directory / str(step)
      try:
        restored = self._restore(path, like)
      except _Damaged as e:
        logging.warning(
            "checkpoint %s is damaged: %s; trying an older one", path, e
        )
        damaged.append((step, str(e)))
        continue
      self._set_aside([step for step, _ in damaged])
      state, record = restored
      return state, {k: v for k, v in record.items() if k not in _RESERVED}
    if damaged:
      raise RuntimeError(
          f"none of the {len(damaged)} checkpoints in"
          f" {self._manager.directory}"
          " verifies: "
          + "; ".join(f"step {step}: {why}" for step, why in damaged)
          + ". Move them away to start the run over."
      )
    return None

  def _restore(self, path: epath.Path, like: Any) -> tuple[Any, dict]:
    """The state and record at ``path``; raises ``_Damaged`` on every
    process alike if either cannot be read or the state does not verify.

    Read through orbax's handlers, not the manager: the manager's restore
    ends in a barrier that a process whose read failed would never reach.
    ``_agree`` is where the processes meet instead.
    """
    record, error = None, None
    try:
      record = ocp.JsonCheckpointHandler().restore(
          path / "record", args=ocp.args.JsonRestore()
      )
      if missing := [k for k in _RESERVED if k not in record]:
        error = f"its record lacks {missing}"
    except Exception as e:  # pylint: disable=broad-except
      error = f"its record cannot be read: {_describe(e)}"
    _agree(error)
    self._check_run(path, record["run"])
    handler = ocp.StandardCheckpointHandler()
    try:
      state = handler.restore(
          path / "state",
          args=ocp.args.StandardRestore(
              acp_checkpoint.target(str(path / "state"), like)
          ),
      )
    except Exception as e:  # pylint: disable=broad-except
      error = f"its arrays cannot be read: {_describe(e)}"
    finally:
      handler.close()
    _agree(error)
    # Computed collectively: the same on every process.
    now = checksums(state)
    saved = record["checksums"]
    differ = sorted(
        k for k in set(now) | set(saved) if now.get(k) != saved.get(k)
    )
    if differ:
      raise _Damaged(
          f"checksums differ for {len(differ)} of {len(saved)} arrays:"
          f" {', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}"
      )
    return state, record

  def _check_run(self, path: epath.Path, saved: dict[str, Any]) -> None:
    saved, now = _flatten(saved), _flatten(self._run)

    def show(flat, key):
      return repr(flat[key]) if key in flat else "none"

    differ = [
        f"{key}={show(saved, key)}, this run has {show(now, key)}"
        for key in sorted(set(saved) | set(now))
        if key not in saved or key not in now or saved[key] != now[key]
    ]
    if differ:
      raise ValueError(
          f"checkpoint {path} was saved with "
          + "; ".join(differ)
          + ". Resume with the same settings, or use another workdir."
      )

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    if jax.process_index() == 0:
      stamp = time.strftime("%Y%m%d-%H%M%S")
      root = self._manager.directory
      for step in steps:
        (root / str(step)).rename(root / f"{step}.damaged-{stamp}")
    multihost_utils.sync_global_devices("Checkpointer set aside damaged")
    self._manager.reload()

  def close(self) -> None:
    self._manager.close()


def _describe(error: Exception) -> str:
  """The first line of the error at the root of ``error``'s chain: where
  TensorStore says what is wrong with which file, beneath orbax's wrapping."""
  while (cause := error.__cause__ or error.__context__) is not None:
    error = cause
  first_line = str(error).partition("\n")[0]
  return f"{type(error).__name__}: {first_line}"


def _agree(error: str | None) -> None:
  """Raises ``_Damaged`` on every process if ``error`` is set on any.

  A damaged shard may be read by one process only; the others must skip the
  checkpoint too, or they would wait forever in the next collective.
  """
  failed = multihost_utils.process_allgather(np.int32(error is not None))
  if error is not None:
    raise _Damaged(error)
  if failed.any():
    raise _Damaged(
        f"process {', '.join(map(str, np.flatnonzero(failed)))} could not"
        " read it"
    )
