"""What a run reports: metrics.jsonl, the params' digest, summaries."""

import json
import numbers
import os
from typing import Any

from absl import logging
import jax
import numpy as np

from train import checks
from train import digest
from train import disk


def params_digest(params) -> str:
  """SHA-256 of a tree's arrays: their bytes in tree order, as stored.

  The same params give the same digest in every process and framework that
  hashes the same bytes (``p.detach().numpy()`` of each parameter of a
  float32 ``torch`` model, in order). A ``jax.Array`` is read from this
  process's devices, each distinct slice once, in index order (a replicated
  array is read once); an array of another kind through ``np.asarray``.

  Raises:
    RuntimeError: naming the leaf, if two devices here hold different values
      for the same slice (replicas that drifted apart). NaN equals NaN:
      identical non-finite replicas have not drifted.
  """
  return digest.sha256(_host_arrays(params))


def _host_arrays(params):
  """The arrays ``params_digest`` hashes, in order (see there)."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if not isinstance(x, jax.Array):
      yield np.asarray(x)
      continue
    slices = {}
    for shard in x.addressable_shards:
      key = tuple((s.start, s.stop) for s in shard.index)
      data = np.asarray(shard.data)
      first = slices.setdefault(key, data)
      nan_ok = np.issubdtype(data.dtype, np.inexact)
      if not np.array_equal(first, data, equal_nan=nan_ok):
        raise RuntimeError(
            f"replicas of params{jax.tree_util.keystr(path)} differ across"
            " devices"
        )
    for key in sorted(slices, key=lambda k: [(s or 0) for s, _ in k]):
      yield slices[key]


def read_records(path: str) -> list[dict[str, Any]]:
  """The records of the ``metrics.jsonl`` at ``path``. A run killed
  mid-write leaves its last line cut short: that line is dropped with a
  warning; damage anywhere else is not ours to repair."""
  with open(path, "rb") as f:
    lines = f.readlines()
  records = []
  for number, line in enumerate(lines, start=1):
    where = f"{path}, line {number}"
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:  # json.dumps writes ASCII only
      raise ValueError(f"{where} is not UTF-8 ({e}): {line!r}") from e
    try:
      record = json.loads(text)
    except json.JSONDecodeError as e:
      if number < len(lines):
        raise ValueError(f"{where} is not JSON ({e}): {text!r}") from e
      logging.warning(
          "%s is not JSON (%s); dropped as a write cut short: %r",
          where,
          e,
          text,
      )
      continue
    step = record.get("step") if isinstance(record, dict) else None
    if not checks.is_int(step):
      raise ValueError(
          f"{where} is not a metrics record (a JSON object with an int"
          f' "step"): {text!r}. Repair or remove that line.'
      )
    records.append(record)
  return records


class MetricsLog:
  """``workdir/metrics.jsonl``, written by process 0 only.

  The file must lie inside ``workdir``: a symlink out of it (left by a
  copied or shared workdir) would have this run rewrite another run's log.
  A run resumed at ``resume_step`` keeps the lines up to it. Every line,
  those past it too, must carry its ``run_id``: lines of another run mean
  that the checkpoints were copied in from elsewhere, and the log would
  splice two runs or drop the other's lines. A run that starts afresh
  where another run's log lies moves that log aside, and says where.
  """

  def __init__(self, workdir: str, resume_step: int, run_id: str | None = None):
    self._path = os.path.join(workdir, "metrics.jsonl")
    self._active = jax.process_index() == 0
    if not self._active:
      return
    root, target = os.path.realpath(workdir), os.path.realpath(self._path)
    if os.path.commonpath([root, target]) != root:
      raise ValueError(
          f"{self._path} is a symlink to {target}, outside the workdir;"
          " this run would rewrite that file. Remove the symlink (or use"
          " another workdir)."
      )
    self._path = target
    if os.path.exists(self._path):
      records = read_records(self._path)
      if not resume_step and _other_runs(records, run_id):
        _move_aside(self._path, records)
        return
      _check_one_run(self._path, records, resume_step, run_id)
      # Lines past the restored checkpoint come from this run, interrupted,
      # and are about to be logged again.
      with open(self._path, "w") as f:
        f.writelines(
            json.dumps(r) + "\n" for r in records if r["step"] <= resume_step
        )

  def write(self, record: dict[str, Any]) -> None:
    if not self._active:
      return
    try:
      with open(self._path, "a") as f:
        f.write(json.dumps(record) + "\n")
    except OSError as e:
      if not disk.no_space(e):
        raise
      raise disk.full(f"step {record['step']}'s metrics", self._path) from None


def _other_runs(records, run_id) -> list[str]:
  """The runs other than ``run_id`` that logged ``records``."""
  if run_id is None:
    return []
  return sorted({str(r.get("run")) for r in records} - {run_id})


def _move_aside(path: str, records) -> None:
  """Moves another run's log at ``path`` to a name of its own, beside it,
  and says so."""
  aside = base = f"{path}.run-{records[0].get('run')}"
  n = 1
  while os.path.exists(aside):
    aside, n = f"{base}.{n}", n + 1
  os.replace(path, aside)
  logging.warning(
      "%s held the log of another run (steps %d-%d) and no checkpoint of it:"
      " moved to %s",
      path,
      min(r["step"] for r in records),
      max(r["step"] for r in records),
      aside,
  )


def _check_one_run(path, records, resume_step: int, run_id) -> None:
  """Raises unless every record of a resumed run's log was logged by
  ``run_id``."""
  if not resume_step or run_id is None:
    return
  others = _other_runs(records, run_id)
  if others:
    steps = [r["step"] for r in records if r.get("run") != run_id]
    raise checks.Refused(
        f"{path} holds steps {min(steps)}-{max(steps)} of run"
        f" {', '.join(others)}, but the checkpoint of step {resume_step} was"
        f" saved by run {run_id}: the checkpoints in"
        f" {os.path.dirname(path)}/checkpoints come from another run, and"
        " resuming would splice the two runs' logs. Move the checkpoints"
        " (or metrics.jsonl and tensorboard/) away, or resume in the"
        " workdir they came from."
    )


class TensorBoardLog:
  """Each record's numbers as TensorBoard scalars in ``workdir/tensorboard``.

  The tags are the keys of ``metrics.jsonl`` (``loss``, ``eval_accuracy``,
  ``bytes_sent_total``, ...), written by process 0 through tensorboardX,
  which needs no TensorFlow. Without tensorboardX installed, nothing is
  written and a warning says so. A resumed run hides the steps after its
  checkpoint that an interrupted run had written, as ``metrics.jsonl`` drops
  them. A full disk is one line naming the directory; the writer is then
  dropped, so that closing it adds no more.
  """

  def __init__(self, workdir: str, resume_step: int):
    self._writer = None
    self._directory = os.path.join(workdir, "tensorboard")
    if jax.process_index() != 0:
      return
    try:
      import tensorboardX  # pylint: disable=g-import-not-at-top
    except ImportError:
      logging.warning(
          "tensorboardX is not installed: no TensorBoard summaries (pip"
          " install tensorboardX, or the train extra)"
      )
      return
    self._writer = tensorboardX.SummaryWriter(
        self._directory,
        purge_step=resume_step + 1 if resume_step else None,
    )

  def write(self, record: dict[str, Any]) -> None:
    if self._writer is None:
      return
    try:
      for key, value in record.items():
        if key != "step" and isinstance(value, numbers.Real):
          self._writer.add_scalar(key, value, record["step"])
      # Records come every log_every_steps: a crash loses none of them.
      self._writer.flush()
    except Exception as e:  # pylint: disable=broad-except
      if not disk.no_space(e):
        raise
      self._drop()
      raise disk.full(
          f"step {record['step']}'s TensorBoard summaries", self._directory
      ) from None

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def _drop(self) -> None:
    """Closes the writer after a full disk, whose closing fails alike."""
    writer, self._writer = self._writer, None
    try:
      writer.close()
    except Exception as e:  # pylint: disable=broad-except
      if not disk.no_space(e):
        raise
      # Closed as tensorboardX's close does, but its flush: else its thread
      # and its hook at exit would each meet the full disk again.
      # pylint: disable=protected-access
      for file_writer in (writer.all_writers or {}).values():
        events = file_writer.event_writer
        events._worker.stop()
        events._event_queue.close()
        events._closed = True


class Logs:
  """Several logs written as one: ``write`` and ``close`` go to each."""

  def __init__(self, *logs):
    self._logs = logs

  def write(self, record: dict[str, Any]) -> None:
    for log in self._logs:
      log.write(record)

  def close(self) -> None:
    for log in self._logs:
      if hasattr(log, "close"):  # MetricsLog opens its file per write
        log.close()


def read_curves(workdir: str) -> list[dict[str, Any]]:
  """``workdir/metrics.jsonl`` by step: a step's train and eval lines merged,
  in step order."""
  by_step: dict[int, dict[str, Any]] = {}
  for record in read_records(os.path.join(workdir, "metrics.jsonl")):
    by_step.setdefault(record["step"], {}).update(record)
  return [by_step[step] for step in sorted(by_step)]


def format_summary(summary: dict[str, Any]) -> str:
  """A one-screen report of a finished run."""
  rows = [
      ("compressor", summary["compressor"]),
      ("devices", summary["num_devices"]),
      ("steps", summary["step"]),
  ]
  if "skipped_steps" in summary:
    rows.append(("skipped steps", summary["skipped_steps"]))
  for key in ("loss", "accuracy", "eval_loss", "eval_accuracy"):
    if key in summary:
      rows.append((key, f"{summary[key]:.4f}"))
  phases = summary["bytes_per_phase"]
  rows.append(
      (
          "bytes/step/device",
          f"{summary['bytes_per_step']:,.0f}"
          + (
              f" (phases {', '.join(f'{b:,}' for b in phases)})"
              if len(phases) > 1
              else ""
          ),
      )
  )
  if summary["examples_per_sec"]:
    rows.append(("examples/s", f"{summary['examples_per_sec']:,.0f}"))
  rows.append(("params sha256", summary["params_sha256"]))
  return "\n".join(f"{k:>18}  {v}" for k, v in rows)


def format_comparison(summaries: list[dict[str, Any]]) -> str:
  """Runs side by side: held-out accuracy and loss, bytes per compressing
  step and per step of the whole run (a dense warm-up included), and
  throughput."""
  lines = [
      f"{'compressor':<12}{'eval acc':>10}{'eval loss':>11}"
      f"{'bytes/step':>14}{'run mean':>12}{'vs ssgd':>9}{'examples/s':>12}"
  ]
  mean = {
      s["compressor"]: s["bytes_sent"] / max(s["step"], 1) for s in summaries
  }
  dense = mean.get("ssgd")
  for s in summaries:
    ratio = f"{dense / mean[s['compressor']]:.1f}x" if dense else "-"
    speed = s["examples_per_sec"]
    lines.append(
        f"{s['compressor']:<12}{s['eval_accuracy']:>10.4f}"
        f"{s['eval_loss']:>11.4f}{s['bytes_per_step']:>14,.0f}"
        f"{mean[s['compressor']]:>12,.0f}{ratio:>9}"
        f"{(f'{speed:,.0f}' if speed else '-'):>12}"
    )
  return "\n".join(lines)
