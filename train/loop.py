"""The pieces of the train loop, each with its own state: a step timer, the
log, the failure policy, periodic evaluation and periodic checkpoints.

``train.train.train_and_evaluate`` composes them; each can be read, and
tested, on its own.
"""

import math
import os
import statistics
import time
from typing import Any, Callable

from absl import logging
import jax
import numpy as np
import tqdm

from train import checkpoint
from train import metrics as metrics_lib
from train import runtime

# The metrics checked before anything is saved, in the order they arise;
# then ``state_nonfinite``, which covers every floating array of the state.
FINITE_METRICS = ("loss", "grad_norm", "update_norm", "param_norm")
# The divergence guard's metrics: for the loop, not the log.
GUARD = ("loss_start", "diverged")


def due(step: int, every: int, last: int) -> bool:
  """Whether a periodic action runs after ``step``: every ``every`` steps
  (0: never) and after the ``last``."""
  return step == last or (every > 0 and step % every == 0)


class StepTimer:
  """Seconds per step, from the previous step's completion to its own.

  A step is taken as completed where the host first waits for it
  (``completed``: right after the step where the loop blocks, else when its
  metrics are read); ``pause`` after evaluating or saving, so that neither
  is counted.
  """

  def __init__(self):
    self.durations = []
    self._done = {}
    self._last = time.perf_counter()

  def completed(self, step: int) -> None:
    if step not in self._done:
      now = time.perf_counter()
      self._done[step], self._last = now - self._last, now

  def take(self, step: int) -> float:
    """``step``'s duration, recorded in ``durations``."""
    self.completed(step)
    seconds = self._done.pop(step)
    self.durations.append(seconds)
    return seconds

  def pause(self) -> None:
    self._last = time.perf_counter()

  def total(self) -> float:
    """Seconds of the steps taken so far by this process (since it started
    or resumed), evaluations and saves left out."""
    return sum(self.durations)

  def median_after(self, warm: int) -> float | None:
    """The median duration past the first ``warm`` steps (those that
    compile), or of all if there are no more; None before any step."""
    steady = self.durations[warm:] or self.durations
    return statistics.median(steady) if steady else None


class TrainLog:
  """``metrics.jsonl`` and TensorBoard (process 0), and a progress bar on a
  terminal: a train line every ``log_every_steps`` and at the end, each
  held-out evaluation."""

  def __init__(self, experiment, workdir: str, start: int, run_id: str):
    self._experiment = experiment
    config = experiment.config
    self._every, self._last = config.log_every_steps, config.num_train_steps
    self._bytes = experiment.bytes_per_phase()
    self._run_id = run_id
    self._log = metrics_lib.Logs(
        metrics_lib.MetricsLog(workdir, start, run_id),
        metrics_lib.TensorBoardLog(workdir, start),
    )
    # disable=None: a bar on a terminal only, none in redirected logs.
    self._bar = tqdm.tqdm(
        total=self._last,
        initial=start,
        disable=None if jax.process_index() == 0 else True,
        desc="train",
        leave=False,
    )

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._bar.close()
    self._log.close()
    return False

  def train(self, step: int, metrics: dict[str, float], seconds: float):
    experiment = self._experiment
    if due(step, self._every, self._last):
      phase = experiment.compressor.phase_at(step - 1)
      self._log.write(
          {
              "step": step,
              "run": self._run_id,
              **{k: v for k, v in metrics.items() if k not in GUARD},
              "learning_rate": float(experiment.schedule(step - 1)),
              "bytes_sent": self._bytes[phase],
              "bytes_sent_total": experiment.bytes_through(step),
              "examples_per_sec": experiment.global_batch / seconds,
          }
      )
    self._bar.update(1)
    self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)

  def evaluation(self, step: int, metrics: dict[str, float]) -> None:
    self._log.write(
        {
            "step": step,
            "run": self._run_id,
            **metrics,
            # So that held-out curves can be drawn against bytes.
            "bytes_sent_total": self._experiment.bytes_through(step),
        }
    )


class Evaluation:
  """The held-out metrics every ``eval_every_steps`` and at the end;
  ``latest`` holds the last ones, evaluated after ``step``."""

  def __init__(self, config, evaluate: Callable[[Any], dict[str, float]]):
    self._every, self._last = config.eval_every_steps, config.num_train_steps
    self._evaluate = evaluate
    self.latest = {}
    self.step = None  # the step ``latest`` was evaluated after

  def due(self, step: int) -> bool:
    return due(step, self._every, self._last)

  def __call__(self, state) -> dict[str, float]:
    self.latest = self._evaluate(state)
    self.step = int(state.step)
    return self.latest


class Target:
  """The held-out loss a run trains to: it stops at the first evaluation
  whose ``eval_loss`` is at most ``config.target_eval_loss`` (None: it runs
  its ``num_train_steps``, the cap). ``step`` is that evaluation's step, or
  None while the target is not reached."""

  def __init__(self, config):
    self.loss = config.get("target_eval_loss")
    self.step = None

  def reached(self, step: int, metrics: dict[str, float]) -> bool:
    """Whether held-out ``metrics``, evaluated after ``step``, reach it."""
    if self.loss is not None and metrics.get("eval_loss", math.inf) <= self.loss:
      self.step = step
    return self.step is not None


class Checkpoints:
  """The run's checkpoints: the latest restored at start, one saved every
  ``checkpoint_every_steps``, at the end and when asked to stop.

  ``last_good`` is the step of the newest checkpoint known to hold a finite
  state: every state saved here has passed the step's check first, a
  restored one is checked. ``loss_start``, the divergence guard's reference
  (the loss at the start of training), is saved in each record, so that a
  resumed run guards as one that never stopped.
  """

  def __init__(
      self,
      experiment,
      workdir: str,
      run: dict[str, Any],
      loader,
      settings: dict[str, Any] | None = None,
  ):
    config = experiment.config
    self._every, self._last = (
        config.checkpoint_every_steps,
        config.num_train_steps,
    )
    self._loader = loader
    self._ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=config.keep_checkpoints,
        run=run,
        settings=settings,
    )
    self.last_good = None
    self.loss_start = np.inf
    self.skipped = 0  # steps skipped before the restored checkpoint
    # Which run this is: drawn at a fresh start, kept in every record, so
    # that the log of a resumed run can be told from another run's.
    self.run_id = None

  def restore(self, state, is_finite: Callable[[Any], bool]):
    """``(state, step)``: the latest checkpoint's, else ``state`` and 0."""
    restored = self._ckpt.restore_latest(like=state)
    if not restored:
      self.run_id = runtime.new_run_id()
      return state, 0
    state, record = restored
    step = record["step"]
    checkpoint.check_resume(record, self._loader.position(step))
    if is_finite(state):
      self.last_good = step
    if record.get("loss_start") is not None:
      self.loss_start = record["loss_start"]
    self.skipped = record.get("skipped", 0)
    self.run_id = record.get("run_id")
    return state, step

  def due(self, step: int) -> bool:
    return due(step, self._every, self._last)

  def save(
      self, step: int, state, metrics: dict[str, float], skipped: int
  ) -> None:
    """Saves ``state`` after ``step``, whose ``metrics`` (read and checked
    before) carry the loss at the start of training; ``skipped`` steps of
    the run so far were skipped."""
    loss_start = metrics.get("loss_start", np.inf)
    self._ckpt.save(
        step,
        state,
        {
            "step": step,
            "data": self._loader.position(step),
            "loss_start": (
                float(loss_start) if np.isfinite(loss_start) else None
            ),
            "skipped": skipped,
            "run_id": self.run_id,
        },
    )
    self.last_good = step  # its metrics, state check included, just read

  def close(self) -> None:
    self._ckpt.close()


class TooManySkipped(FloatingPointError):
  """A run with ``nonfinite="skip"`` skipped more than
  ``max_skipped_fraction`` of its steps; ``summary`` is its summary."""

  def __init__(self, message: str, summary: dict[str, Any]):
    super().__init__(message)
    self.summary = summary


class FailurePolicy:
  """What a step whose metrics are not sane does: one skipped by the step
  itself (``nonfinite="skip"``) is logged as a warning and counted in
  ``skipped``; otherwise a non-finite number, or a loss past
  ``divergence_factor`` times the loss at the start of training, stops the
  run with an error naming the step, what went wrong and the checkpoint to
  resume from."""

  def __init__(self, config, checkpoints: Checkpoints):
    self._factor = config.get("divergence_factor") or 0.0
    self._max_skipped = config.max_skipped_fraction
    self._checkpoints = checkpoints
    self.skipped = checkpoints.skipped

  def check(self, step: int, metrics: dict[str, float]) -> None:
    if metrics.get("skipped"):
      self.skipped += 1
      logging.warning("step %d skipped: %s", step, self._reason(metrics))
    elif metrics.get("diverged"):
      raise FloatingPointError(self._diverged(step, metrics))
    elif first := first_nonfinite(metrics):
      raise FloatingPointError(
          f"{first} is not finite at step {step}; nothing from this step is"
          f" saved, and {self._kept(step, diverged=False)}. Lower"
          " config.optimizer.learning_rate, check the data, or set"
          " config.nonfinite='skip' to skip such steps."
      )

  def check_skipped(self, summary: dict[str, Any]) -> None:
    """Raises ``TooManySkipped`` if the run, now at ``summary["step"]``,
    skipped more than ``max_skipped_fraction`` of its steps."""
    steps = summary["step"]
    if self.skipped <= self._max_skipped * steps:
      return
    raise TooManySkipped(
        f"config.nonfinite='skip' skipped {self.skipped} of the run's"
        f" {steps} steps ({self.skipped / steps:.0%}), more than"
        f" config.max_skipped_fraction={self._max_skipped:g}: the params"
        " are those of the steps kept, not a trained run. Lower"
        " config.optimizer.learning_rate or check the data; the warnings"
        " above name each skipped step and why.",
        summary,
    )

  def _reason(self, metrics: dict[str, float]) -> str:
    if metrics.get("diverged"):
      return (
          f"the loss {metrics['loss']:.4g} is past"
          f" config.divergence_factor={self._factor:g} times the loss at the"
          f" start of training, {metrics['loss_start']:.4g}"
      )
    return f"a non-finite {first_nonfinite(metrics)}"

  def _diverged(self, step: int, metrics: dict[str, float]) -> str:
    return (
        f"the loss {metrics['loss']:.6g} at step {step} exceeds"
        f" config.divergence_factor={self._factor:g} times the loss at the"
        f" start of training, {metrics['loss_start']:.6g}: the run diverged;"
        f" nothing from this step is saved, and"
        f" {self._kept(step, diverged=True)}. Training is deterministic, so"
        " the same settings diverge again: lower"
        " config.optimizer.learning_rate or lengthen"
        " config.schedule.warmup_steps and run again to resume"
        " (config.nonfinite='skip' skips single bad batches instead;"
        " config.divergence_factor=0 turns the guard off)."
    )

  def _kept(self, step: int, diverged: bool) -> str:
    """Which checkpoint holds a good state. A loss is the loss of the
    state the step before made: after a divergence, a checkpoint of that
    step holds the state that gave it."""
    good = self._checkpoints.last_good
    if good is None:
      return "no checkpoint holds a finite state, so a rerun starts over"
    if diverged and good == step - 1:
      return (
          f"checkpoint {good} holds the state that gave this loss (a rerun"
          " resumes from it; remove it to resume from an older one)"
      )
    if diverged:
      return f"checkpoint {good} holds the last good state saved"
    return (
        f"checkpoint {good}, checked finite, holds the last good state saved"
    )


def first_nonfinite(metrics: dict[str, float]) -> str | None:
  """The first of ``FINITE_METRICS`` whose value is not finite, else a word on
  the state if an array of it is not, else None."""
  first = next((k for k in FINITE_METRICS if not np.isfinite(metrics[k])), None)
  if first is None and metrics["state_nonfinite"]:
    return "an array of the state (BatchNorm statistics, optimizer, compressor)"
  return first


class StepRecorder:
  """Reads each step's metrics one step late, so that the host never
  stalls the device, then times, checks and logs the step; ``latest`` holds
  the last metrics read."""

  def __init__(self, timer: StepTimer, policy: FailurePolicy, log: TrainLog):
    self._timer, self._log = timer, log
    self.policy = policy
    self._pending = None
    self.latest = {}

  def push(self, step: int, device_metrics: dict[str, jax.Array]) -> None:
    """Records the step before, then holds ``step``'s metrics."""
    self.flush()
    self._pending = (step, device_metrics)

  def flush(self) -> None:
    """Records the step held, if any."""
    if self._pending is None:
      return
    step, device_metrics = self._pending
    self._pending = None
    metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    seconds = self._timer.take(step)
    self.policy.check(step, metrics)
    self._log.train(step, metrics, seconds)
    self.latest = metrics
