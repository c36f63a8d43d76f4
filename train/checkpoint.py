"""Verified orbax checkpoints of the whole training state.

A checkpoint holds the train state (params, batch statistics, the
compressor's state with every device's residuals but its factors once, the
optimizer's state, the step and the RNG key) and a JSON record: what the
caller passes (step, data position), the run it belongs to, the layout and a
checksum of every array (``acp_jax.checkpoint``'s), and a digest of the
record itself. Orbax writes each to a temporary directory and renames it
when complete, so a crash mid-save leaves the previous checkpoint as the
latest.

``Checkpointer.restore_latest`` resumes from the newest checkpoint that
verifies. One whose record, files or arrays are not as saved is damaged: it
is set aside with a warning, and the next older one is tried. One saved by
another run (another compressor, model, batch size, seed or device count, or
another state layout) is refused, naming saved and now, before any array is
read. One whose state has another structure than this run's (another
momentum, say) is refused naming the settings that differ, when its record
holds them. The restore target comes from ``acp_jax.checkpoint.target``: ACP-SGD's
phase from the checkpoint, everything else checked against the live state.
Checkpoints are never followed through a symbolic link.
"""

import json
import os
import shutil
import time
from typing import Any

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

import acp_jax
from acp_jax import checkpoint as acp_checkpoint
from train import checks
from train import disk

# The layout of a checkpoint and its record, raised when either changes.
# Older formats in ``_UPGRADES`` are read, filling what they lack; any other
# is refused as version skew, naming the version that wrote it. 1: records
# before the format was recorded.
FORMAT = 2
# Keys the Checkpointer adds to each record.
_RESERVED = ("run", "checksums", "layout", "format", "written_by")
# Added to each record too, but not required in one: records of format 2
# written before it lack it.
_SETTINGS = "settings"
# Damaged checkpoints set aside and kept for inspection, the newest first.
KEEP_DAMAGED = 3


def log_abandoned_reads() -> None:
  """``acp_jax.checkpoint.log_abandoned_reads`` into the debug log
  (``--verbosity=1``): a damaged checkpoint's one line on the console, the
  tracebacks of the reads it abandoned in the log."""

  def log(text: str) -> None:
    if logging.level_debug():
      logging.debug("%s", text)

  acp_checkpoint.log_abandoned_reads(log)


class Checkpointer:
  """Saves verified checkpoints of one run, keeps the last ``keep``.

  Args:
    directory: where the checkpoints go, one subdirectory per step; a
      directory, or a path where one can be made (not a file, not a
      symbolic link).
    keep: how many of the newest checkpoints to keep (0: all of them).
    run: what a checkpoint must share with this run to be resumed by it
      (compressor, model, device count, the params' shapes...), as
      JSON-serializable nested dicts: saved in every record, compared on
      restore.
    settings: what else shapes the state (the optimizer's arguments, such
      as its momentum), as nested dicts keyed by the names an operator sets:
      saved in every record, not compared on restore (a learning rate may
      change), but named, saved and now, when a checkpoint's state has
      another structure.
  """

  def __init__(
      self,
      directory: str,
      *,
      keep: int,
      run: dict[str, Any],
      settings: dict[str, Any] | None = None,
  ):
    checks.integer("keep", keep, 0)
    self._run = _json("run", run)
    self._settings = _json("settings", settings or {})
    directory = os.path.abspath(directory)
    if os.path.islink(directory):
      raise ValueError(
          f"{directory} is a symbolic link: checkpoints are not followed out"
          " of the workdir; make it a directory"
      )
    if os.path.lexists(directory) and not os.path.isdir(directory):
      raise ValueError(
          f"{directory} must be a directory for the checkpoints, but it is a"
          " file: move it away, or use another workdir"
      )
    self._keep = keep
    self._manager = ocp.CheckpointManager(
        directory,
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
    """Writes ``state`` and ``record`` (with the run, layout and checksums
    added, and sealed with a digest) as checkpoint ``step``, then deletes all
    but the newest ``keep``.

    Raises:
      OSError: ENOSPC, one line naming the directory, if the disk is full;
        the checkpoints saved before are kept as they were.
    """
    if reserved := sorted({*_RESERVED, _SETTINGS} & set(record)):
      raise ValueError(
          f"record must not hold {reserved}: the Checkpointer writes them"
      )
    sealed = acp_checkpoint.sealed(
        {
            **record,
            "run": self._run,
            _SETTINGS: self._settings,
            "format": FORMAT,
            "written_by": written_by(),
            "checksums": acp_checkpoint.checksums(state),
            "layout": acp_checkpoint.layout(state),
        }
    )
    try:
      self._manager.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              record=ocp.args.JsonSave(sealed),
          ),
      )
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if not disk.no_space(e):
        raise
      self._remove_partial(step)
      raise disk.full(f"checkpoint {step}", self._manager.directory) from None
    if self._keep:
      for old in sorted(self._manager.all_steps())[: -self._keep]:
        self._delete(old)

  def restore_latest(self, like: Any) -> tuple[Any, dict[str, Any]] | None:
    """The newest checkpoint that verifies, laid out like ``like``.

    Damaged checkpoints (a record, file or array not as saved) are skipped
    with a warning; when an older one verifies, the skipped ones are renamed
    ``STEP.damaged-TIME`` (kept for inspection, the newest ``KEEP_DAMAGED``
    of them, out of the way of the steps this run will save again). A
    checkpoint that is a symbolic link is skipped, never followed.

    Args:
      like: the live state, e.g. freshly initialized: its structure, shapes,
        dtypes and shardings are what the restore produces (see
        ``acp_jax.checkpoint.target``).

    Returns:
      ``(state, record)`` with the record as passed to ``save``, or None if
      the directory holds no checkpoint.

    Raises:
      checks.Refused: if a checkpoint was saved by another run (each differing
        key of ``run`` named with both values) or of another state layout
        (each differing key of ``settings`` named, if any); nothing is read
        from it.
      checks.Refused: if there are checkpoints but none of them verifies.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    root = self._manager.directory
    links = [step for step in steps if os.path.islink(root / str(step))]
    for step in links:
      logging.warning(
          "checkpoint %s is a symbolic link: not followed; renamed"
          " %s.link-TIME, out of the way of the steps this run saves",
          root / str(step),
          step,
      )
    self._set_aside(links, "link")
    damaged = []
    for step in steps:
      if step in links:
        continue
      path = root / str(step)
      try:
        restored = self._restore(path, like)
      except acp_checkpoint.DamagedError as e:
        logging.warning(
            "checkpoint %s is damaged: %s; trying an older one", path, e.reason
        )
        damaged.append((step, e.reason))
        continue
      self._set_aside([step for step, _ in damaged])
      state, record = restored
      return state, {
          k: v for k, v in record.items() if k not in (*_RESERVED, _SETTINGS)
      }
    if damaged:
      raise checks.Refused(
          f"none of the {len(damaged)} checkpoints in"
          f" {self._manager.directory}"
          " verifies: "
          + "; ".join(f"step {step}: {why}" for step, why in damaged)
          + ". Move them away to start the run over."
      )
    return None

  def _restore(self, path: epath.Path, like: Any) -> tuple[Any, dict]:
    """The state and record at ``path``; raises ``DamagedError`` on every
    process alike if either is not as saved.

    Read through orbax's handlers, not the manager: the manager's restore
    ends in a barrier that a process whose read failed would never reach.
    ``_agree`` is where the processes meet instead.
    """
    raw, record, error = None, None, None
    try:
      raw = ocp.JsonCheckpointHandler().restore(
          path / "record", args=ocp.args.JsonRestore()
      )
    except Exception as e:  # pylint: disable=broad-except
      error = (
          "its record cannot be read:"
          f" {acp_checkpoint.describe_read_error(e)}"
      )
    # Another version's record is refused as such, before its seal or keys
    # would call it damaged (the record is one file: every process reads
    # the same).
    _check_format(path, raw)
    if error is None:
      try:
        record = _upgraded(path, acp_checkpoint.unsealed(raw, path))
        if missing := [k for k in _RESERVED if k not in record]:
          error = f"its record lacks {missing}"
      except acp_checkpoint.DamagedError as e:
        error = e.reason
    _agree(path, error)
    # The record is as saved: what differs now is this run's doing.
    self._check_run(path, record["run"], record["written_by"])
    directory = path / "state"
    try:
      abstract = acp_checkpoint.target(
          str(directory), like, saved=record["layout"]
      )
    except acp_checkpoint.DamagedError as e:
      error = e.reason
    except ValueError as e:  # a state of another structure
      self._explain_structure(path, record.get(_SETTINGS), e)
      raise
    _agree(path, error)
    handler = ocp.StandardCheckpointHandler()
    try:
      state = acp_checkpoint.read(
          directory,
          lambda: handler.restore(
              directory, args=ocp.args.StandardRestore(abstract)
          ),
      )
    except acp_checkpoint.DamagedError as e:
      error = e.reason
    finally:
      handler.close()
    _agree(path, error)
    # Computed collectively: the same on every process.
    acp_checkpoint.verify(state, record["checksums"], path)
    return state, record

  def _check_run(
      self, path: epath.Path, saved: dict[str, Any], by: str
  ) -> None:
    if "compressor" in saved:
      saved = {
          **saved,
          "compressor": acp_checkpoint.current_record(
              saved["compressor"], path
          ),
      }
    if differ := acp_checkpoint.differences(
        saved, self._run, now_is="this run has"
    ):
      skew = (
          f" It was written by {by}, and this is {written_by()}."
          if by != written_by()
          else ""
      )
      raise checks.Refused(
          f"checkpoint {path} was saved with "
          + "; ".join(differ)
          + f". Resume with the same settings, or use another workdir.{skew}"
      )

  def _explain_structure(
      self, path: epath.Path, saved: Any, error: ValueError
  ) -> None:
    """Raises ``checks.Refused`` naming the settings that differ from those
    ``saved`` with the checkpoint at ``path``, whose state has another
    structure (``error``), if its record holds them and any differ."""
    if not isinstance(saved, dict):
      return
    if differ := acp_checkpoint.differences(
        saved, self._settings, now_is="this run has"
    ):
      raise checks.Refused(
          f"checkpoint {path} was saved with "
          + "; ".join(differ)
          + ", which gives the optimizer state another structure. Resume"
          " with the saved value, or use another workdir to start over."
          f" ({error})"
      ) from None

  def _delete(self, step: int) -> None:
    path = self._manager.directory / str(step)
    if not os.path.islink(path):
      self._manager.delete(step)
      return
    # Only the link goes: what it points to is not this run's.
    if jax.process_index() == 0:
      path.unlink()
    multihost_utils.sync_global_devices("Checkpointer unlinked a step")
    self._manager.reload()

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left: orbax's temporary
    directory, never a complete checkpoint."""
    if jax.process_index() != 0:
      return
    for path in self._manager.directory.iterdir():
      if path.name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(path, ignore_errors=True)

  def _set_aside(self, steps: list[int], why: str = "damaged") -> None:
    """Renames each of ``steps`` ``STEP.WHY-TIME`` (a link itself, never
    what it points to), then deletes all but the newest ``KEEP_DAMAGED``
    damaged ones."""
    if not steps:
      return
    if jax.process_index() == 0:
      stamp = time.strftime("%Y%m%d-%H%M%S")
      root = self._manager.directory
      for step in steps:
        name, n = f"{step}.{why}-{stamp}", 1
        while os.path.lexists(root / name):
          n += 1
          name = f"{step}.{why}-{stamp}-{n}"
        os.rename(root / str(step), root / name)
      set_aside = sorted(
          (p for p in root.iterdir() if ".damaged-" in p.name),
          key=lambda p: _stamp(p.name),
          reverse=True,
      )
      for old in set_aside[KEEP_DAMAGED:]:
        if os.path.islink(old) or not old.is_dir():
          old.unlink()
        else:
          shutil.rmtree(old)
    multihost_utils.sync_global_devices("Checkpointer set aside damaged")
    self._manager.reload()

  def close(self) -> None:
    self._manager.close()


def _json(name: str, tree: Any) -> Any:
  """``tree`` round-tripped through JSON, so that it compares equal to what a
  record holds (tuples come back as lists)."""
  try:
    return json.loads(json.dumps(tree))
  except TypeError as e:
    raise ValueError(
        f"{name} must be JSON-serializable, got {tree!r}: {e}"
    ) from e


def written_by() -> str:
  """The code that writes checkpoints here, as each record names it."""
  return f"acp_jax {acp_jax.__version__}"


def _format_1(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
  """A record of format 1 (acp_jax before 0.2.0, which wrote no format) as
  format 2 holds it, and what was filled in. The state's arrays are laid
  out alike; the record lacked the run's id (the log's lines carried none
  either), the skipped steps (that version skipped none), the guard's
  reference loss (taken again from the first step resumed) and, in the
  run, JAX_ENABLE_X64 (that version trained in float32)."""
  run = {"JAX_ENABLE_X64": False, **record["run"]}
  filled = {
      **record,
      "run": run,
      "format": 1,
      "written_by": "an acp_jax before 0.2.0",
  }
  return filled, (
      "no run id, no skipped steps, the divergence guard's reference from"
      " the first step resumed, run.JAX_ENABLE_X64=False"
  )


# Each older format this version reads: record -> (record as FORMAT holds
# it, what was filled in).
_UPGRADES = {1: _format_1}


def _upgraded(path: epath.Path, record: dict[str, Any]) -> dict[str, Any]:
  """``record`` (verified) as this format holds it, saying in one line
  what an older format's record was given."""
  saved = record.get("format", 1)
  if saved == FORMAT:
    return record
  record, filled = _UPGRADES[saved](record)
  logging.warning(
      "checkpoint %s is of format %d, written by %s: read as format %d with"
      " %s",
      path,
      saved,
      record["written_by"],
      FORMAT,
      filled,
  )
  return record


def _check_format(path: epath.Path, raw: Any) -> None:
  """Raises ``checks.Refused`` if the record ``raw`` (as read, unverified) was
  written in a checkpoint format this version cannot read: version skew,
  not damage."""
  if not isinstance(raw, dict) or raw.get("format", 1) in (FORMAT, *_UPGRADES):
    return
  saved = raw.get("format", 1)
  by = raw.get("written_by") or (
      "an older version of acp_jax (before checkpoints named it)"
  )
  raise checks.Refused(
      f"checkpoint {path} was written by {by} in checkpoint format {saved};"
      f" this is {written_by()}, which reads formats"
      f" {', '.join(map(str, sorted({*_UPGRADES, FORMAT})))}: version skew,"
      " not damage. Resume it with the version that wrote it, or move"
      f" {path.parent} away to start the run over."
  )


def _stamp(name: str) -> tuple[str, int]:
  """Sort key of ``STEP.damaged-TIME[-N]``: the time, then N."""
  rest = name.partition(".damaged-")[2]
  n = rest[len("YYYYmmdd-HHMMSS-") :]
  return rest[: len("YYYYmmdd-HHMMSS")], int(n) if n.isdigit() else 1


def _agree(path: epath.Path, error: str | None) -> None:
  """Raises ``DamagedError`` on every process if ``error`` is set on any.

  A damaged shard may be read by one process only; the others must skip the
  checkpoint too, or they would wait forever in the next collective.
  """
  failed = multihost_utils.process_allgather(np.int32(error is not None))
  if error is not None:
    raise acp_checkpoint.DamagedError(path, error)
  if failed.any():
    raise acp_checkpoint.DamagedError(
        path,
        f"process {', '.join(map(str, np.flatnonzero(failed)))} could not"
        " read it",
    )


def check_resume(record: dict[str, Any], position: dict[str, int]) -> None:
  """Raises ``checks.Refused`` unless a restored record's data position is the
  ``position`` this run computes for its step: the same data, in the same
  order."""
  if record["data"] != position:
    raise checks.Refused(
        f"the checkpoint of step {record['step']} was saved at data position"
        f" {record['data']}, this run puts that step at {position}: the"
        " dataset changed; resume with the same data, or use another workdir"
    )
