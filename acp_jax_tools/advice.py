"""Which compressor, at which rank: advice from a measurement, before a run
(``acp_jax.advise``).

For a model, a few batches, a number of workers and a link, ``advise``:

1. measures this device's forward and backward time on one worker's share
   of a batch, and times each candidate's update on one device
   (``acp_jax_tools.timing``);
2. reads each candidate's bytes per phase from ``acp_jax.comm_bytes``;
3. predicts each candidate's step with the alpha-beta model
   (``acp_jax_tools.costmodel``): compute and update, plus each phase's
   communication on the link, averaged over the phases;
4. runs the candidates, fastest first, for a few steps on the user's own
   gradients, on the workers simulated by ``jax.vmap``
   (``acp_jax_tools.simulated``), to measure how far each one's compressed mean
   lies from the true mean (S-SGD's): its squared distance in units of the
   sampling noise that the true mean itself carries (``error_to_noise``),
   with the cosine beside it;
5. recommends the fastest candidate whose ``error_to_noise`` is at or below
   a threshold or, of those predicted within ``TIE`` (2 %) of it, the one
   of least error: a tie at the timings' resolution, which the lower error
   breaks, as it reaches a given loss in fewer steps. It stops measuring
   once the pick is sure: a slower candidate cannot be the pick
   (``measure_all`` measures them all). The threshold comes from the
   convergence records (``Calibration``): the highest recorded error at and
   below which every recorded variant ended within ``max_gap`` of S-SGD's
   held-out loss;
6. given ``short_runs`` (``acp_jax_tools.steps.ShortRuns``: the model's
   optimizer and a short run's batches), trains S-SGD and each candidate
   within the threshold that many steps on the simulated workers, reads
   from the runs' held-out losses how many steps each candidate takes per
   S-SGD step to the same loss, and ranks by the time to S-SGD's loss,
   each step's time times those steps, in place of the step's time: a
   faster step that needs more steps can arrive later, which an error
   threshold cannot tell.

Given ``Measurements``, the advice is arithmetic on the accounting, the same
for the same inputs.

Why the error is counted in units of the noise, not as a cosine: SGD
already follows a noisy mean, and a compressor's error matters beside that
noise. At ``error_to_noise = 1`` the compressed mean lies as far from the
true mean as the true mean lies from the full-data gradient: were the two
errors independent, the noise of a batch half the size (error feedback
sends the compressor's error later, so less than that). A cosine leaves
the noise out and does not carry from one model to another: at their
initial params, the char LM's mean of 32 sequences carries a sampling
noise of 2 % of its squared length, and Power-SGD at rank 4 keeps a cosine
of 0.99 with it (an error of 0.7 times that noise); the cluster's BERT
layers, fed 2 sequences a worker, carry a noise as large as their mean, and
the same compressor's cosine is 0.73 (an error of 0.5 times the noise).

The errors are measured as the trainer's configs train: each Power-SGD and
ACP-SGD candidate first takes ``WARMUP`` dense steps (its ``warmup_steps``)
that warm its factors on the true mean, then compresses; the error is the
mean over the steps after the warm-up, all at the given params (the initial
ones, or a checkpoint's). Fresh factors turn far from the mean on their
first steps, ACP-SGD's most, as it refreshes each factor from the other's
previous value; the warm-up takes that start out of the measurement, and
the pick is to be trained with a dense warm-up too (``Advice.compressor``
takes ``warmup_steps``; the trainer's configs carry one). The threshold is
calibrated on errors measured in this same way on the char LM
(``python -m benchmarks advise --calibrate``), for the variants whose
held-out loss the convergence records give after the same kind of warm-up.
It holds for that measurement only: each compressed step's error adds up
in the residuals, so an error averaged over more steps is larger (the
candidates' order stays), and ``advise`` warns when it measures over other
steps than ``WARMUP`` and ``STEPS``.

Power-SGD's and ACP-SGD's updates are timed at the lowest, the middle and
the highest of their ranks; the update at a rank in between is interpolated
linearly in rank (``measure.timed_ranks``), which saves most of the compiles.
"""

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import math
import statistics
from typing import Any
import warnings

import jax

from acp_jax import _checks
from acp_jax import compressor as compressor_lib
from acp_jax import registry
from acp_jax_tools import calibration
from acp_jax_tools import costmodel
from acp_jax_tools.calibration import Calibration
from acp_jax_tools.calibration import MAX_GAP
from acp_jax_tools.candidates import Candidate
from acp_jax_tools.candidates import default_candidates
from acp_jax_tools.measure import Measurements
from acp_jax_tools.measure import measure
from acp_jax_tools.measure import STEPS
from acp_jax_tools.measure import volumes
from acp_jax_tools.measure import WARMUP
from acp_jax_tools.steps import ShortRuns

# Candidates predicted within this fraction of the fastest one within the
# threshold tie with it: the timings cannot tell them apart (two that send
# the same bytes differ by their updates' noise, a fraction of a percent).
# Of those within the threshold, the pick is the one of least error, which
# reaches a given loss in fewer steps.
TIE = 0.02


@dataclasses.dataclass(frozen=True)
class Link:
  """Each worker's link: ``bandwidth`` in bytes per second (``math.inf``
  for a link whose bytes cost nothing) and ``latency`` in seconds per
  message."""

  bandwidth: float
  latency: float = 0.0

  def __post_init__(self):
    calibration.positive_number("bandwidth", self.bandwidth)
    if (
        isinstance(self.latency, bool)
        or not isinstance(self.latency, (int, float))
        or not 0 <= self.latency < math.inf
    ):
      raise ValueError(
          f"latency must be a finite number >= 0, got {self.latency!r}"
      )

  def costs(self) -> costmodel.Link:
    return costmodel.Link(alpha=self.latency, beta=1 / self.bandwidth)


@dataclasses.dataclass(frozen=True)
class Row:
  """One candidate's prediction: ``step_s`` seconds a step (the mean over
  its phases), ``examples_per_s`` of the global batch, ``bytes_per_step``
  (each worker's, ``CommVolume.total``, the mean over the phases),
  ``update_s`` its measured update, and its measured ``error_to_noise`` and
  ``cosine`` (None where not measured), and its measured ``steps`` per
  S-SGD step to the same loss, with the lowest and the highest of its
  short runs (None where no short run measured them)."""

  candidate: Candidate
  step_s: float
  examples_per_s: float
  bytes_per_step: float
  update_s: float
  error_to_noise: float | None
  cosine: float | None
  steps: float | None = None
  steps_low: float | None = None
  steps_high: float | None = None

  @property
  def seconds(self) -> float:
    """What the advice ranks by: the predicted seconds to the loss S-SGD
    reaches in a step, ``step_s`` times ``steps`` (``step_s`` where the
    steps were not measured)."""
    return self.step_s * (1.0 if self.steps is None else self.steps)

  def ties(self, fastest: "Row") -> bool:
    """Whether this row cannot be told from ``fastest`` (ranked first):
    predicted within ``TIE`` of it, or, where short runs measured the
    steps, its time at its lowest steps at most ``fastest``'s at its
    highest (the runs' spread is the steps' resolution)."""
    if self.seconds <= fastest.seconds * (1 + TIE):
      return True
    if self.steps_low is None or fastest.steps_high is None:
      return False
    return self.step_s * self.steps_low <= fastest.step_s * fastest.steps_high

  @classmethod
  def from_dict(cls, row: Mapping[str, Any]) -> "Row":
    """The row that ``as_dict`` (a record's row) was made from."""
    fields = [f.name for f in dataclasses.fields(Candidate)]
    names = [f.name for f in dataclasses.fields(cls)][1:]
    candidate = Candidate(**{f: row[f] for f in fields})
    # Records written before the short runs carry no "steps".
    return cls(candidate, *(row.get(n) for n in names))

  def as_dict(self) -> dict[str, Any]:
    return {
        "name": self.candidate.name,
        **dataclasses.asdict(self.candidate),
        **{
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "candidate"
        },
    }


_COLUMNS = (
    ("candidate", 20, lambda r: r["name"]),
    ("step (s)", 10, lambda r: f"{r['step_s']:.4f}"),
    ("examples/s", 12, lambda r: f"{r['examples_per_s']:.2f}"),
    ("bytes/step", 12, lambda r: f"{r['bytes_per_step']:.0f}"),
    ("update (s)", 11, lambda r: f"{r['update_s']:.4f}"),
    ("err/noise", 11, lambda r: _measured(r["error_to_noise"])),
    ("cosine", 8, lambda r: _measured(r["cosine"])),
    ("steps", 18, lambda r: _steps(r)),
)


def _measured(value: float | None) -> str:
  return "-" if value is None else f"{value:.3f}"


def _steps(row: Mapping[str, Any]) -> str:
  """A row's measured steps, and their range over several short runs."""
  steps, low, high = (row.get(k) for k in ("steps", "steps_low", "steps_high"))
  if steps is None:
    return "-"
  return f"{steps:.2f}" + ("" if low == high else f" ({low:.2f}-{high:.2f})")


def table(record: Sequence[Mapping[str, Any]]) -> str:
  """An advice's record (``Advice.to_record``) as a table: the ranked
  candidates, the pick marked, the link, and the threshold."""
  lines = ["  " + "".join(f"{h:>{w}s}" for h, w, _ in _COLUMNS)]
  for row in record:
    mark = "* " if row["picked"] else "  "
    lines.append(mark + "".join(f"{f(row):>{w}s}" for _, w, f in _COLUMNS))
  first, pick = record[0], next(r for r in record if r["picked"])
  fastest = next(
      r
      for r in record
      if r["error_to_noise"] is not None
      and r["error_to_noise"] <= r["threshold"]
  )
  runs, repeats = first.get("run_steps"), first.get("run_repeats") or 1
  why = (
      "the fastest within the threshold"
      if pick is fastest
      else "of least error of those within the threshold predicted within"
      f" {TIE:.0%} of the fastest of them, {fastest['name']}"
      + (", or whose short runs' times overlap its" if runs else "")
  )
  if runs:
    why += (
        "; ranked by the time to S-SGD's held-out loss: each step's time"
        f" times the steps per S-SGD step of {runs}-step runs (the median"
        f" of {repeats})"
    )
  bandwidth = first["bandwidth"] or math.inf
  lines += [
      f"{first['workers']} workers, link {bandwidth:.4g} B/s and"
      f" {first['latency']:.3g} s, forward and backward"
      f" {first['forward_backward_s']:.4f} s on one worker's"
      f" {first['global_batch'] // first['workers']} examples",
      first["calibration"],
      f"recommended: {pick['name']}, {why}",
  ]
  if any(r["error_to_noise"] is None for r in record):
    lines.append("-: not measured, as slower than the pick")
  elif runs and any(r.get("steps") is None for r in record):
    lines.append("steps -: not run, as beyond the threshold")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Advice:
  """The candidates ranked by predicted step, or by predicted time to
  S-SGD's loss where the steps were measured (fastest first), the pick, and
  what it rests on."""

  rows: tuple[Row, ...]
  pick: Row
  calibration: Calibration
  workers: int
  link: Link
  global_batch: int
  measurements: Measurements
  # The steps of the short runs that measured the candidates' steps, and
  # how many of each; 0: none made.
  run_steps: int = 0
  run_repeats: int = 0

  def compressor(
      self, warmup_steps: int = 0, **kwargs: Any
  ) -> compressor_lib.Compressor:
    """The recommended compressor, made with ``kwargs`` besides its own.

    A low-rank pick's cosine was measured after a dense warm-up that warmed
    its factors: train it with one too (``warmup_steps``, passed to
    Power-SGD and ACP-SGD only).
    """
    if warmup_steps and self.pick.candidate.method in registry.low_rank():
      kwargs["warmup_steps"] = warmup_steps
    return self.pick.candidate.make(**kwargs)

  def table(self) -> str:
    """The ranked candidates, the pick marked, and the threshold."""
    return table(self.to_record())

  def to_record(self) -> list[dict[str, Any]]:
    """The advice as flat JSON-serializable rows, one a candidate, fastest
    first, the pick's ``picked`` true, each with what the advice rests on
    (an infinite bandwidth is written as None)."""
    bandwidth = self.link.bandwidth
    advice = {
        "workers": self.workers,
        "bandwidth": None if math.isinf(bandwidth) else bandwidth,
        "latency": self.link.latency,
        "global_batch": self.global_batch,
        "forward_backward_s": self.measurements.forward_backward,
        "threshold": self.calibration.error_to_noise,
        "max_gap": self.calibration.max_gap,
        "calibration": self.calibration.describe(),
        "run_steps": self.run_steps,
        "run_repeats": self.run_repeats,
    }
    return [
        {**r.as_dict(), "picked": r is self.pick, **advice} for r in self.rows
    ]


def _ranked(
    measurements, volumes, candidates, workers, link, global_batch, overlap
) -> list[Row]:
  """Each candidate's predicted row, fastest first (``recommend``'s
  arguments)."""
  costs = link.costs()
  forward_backward = measurements.forward_backward
  rows = []
  for c in candidates:
    update = measurements.update[c.name]
    phases = volumes[c.name]
    step = statistics.fmean(
        costmodel.step_seconds(
            forward_backward + update,
            costmodel.BACKWARD_SHARE * forward_backward,
            t,
            c.method,
            workers,
            costs,
            overlap,
        )
        for t in costmodel.traffic(phases, c.method)
    )
    rows.append(
        Row(
            c,
            step,
            global_batch / step,
            statistics.fmean(v.total for v in phases.values()),
            update,
            measurements.error_to_noise.get(c.name),
            measurements.cosine.get(c.name),
            measurements.steps.get(c.name),
            *measurements.steps_range.get(c.name, (None, None)),
        )
    )
  rows.sort(
      key=lambda r: (r.seconds, r.step_s, r.bytes_per_step, r.candidate.name)
  )
  return rows


def recommend(
    measurements: Measurements,
    volumes: Mapping[str, Mapping[str, compressor_lib.CommVolume]],
    candidates: Sequence[Candidate],
    *,
    workers: int,
    link: Link,
    global_batch: int,
    calibration: Calibration,
    overlap: bool = False,
    run_steps: int = 0,
    run_repeats: int = 0,
) -> Advice:
  """The advice from measurements and each candidate's ``comm_bytes``
  (``volumes``, by candidate name): arithmetic only.

  With ``overlap``, the pipelined methods (``registry.Entry.pipelined``)
  hide their communication behind backprop, as GPU runtimes can; XLA:CPU
  does not. ``run_steps`` and ``run_repeats``: the steps of the short runs that
  measured ``measurements.steps``, and how many of each, for the record.
  """
  _checks.integer("workers", workers, 1)
  _checks.integer("global_batch", global_batch, 1)
  rows = _ranked(
      measurements, volumes, candidates, workers, link, global_batch, overlap
  )
  pick, unmeasured = choose(rows, measurements.error_to_noise, calibration)
  if unmeasured is not None:
    raise ValueError(
        f"{unmeasured.candidate.name} is predicted faster than every"
        f" candidate within the threshold, or within {TIE:.0%} of the"
        " fastest of them, but its error was not measured: give"
        " measurements.error_to_noise for it"
    )
  if pick is None:
    raise ValueError(
        "no candidate is within the threshold error/noise"
        f" {calibration.error_to_noise:.3f}; include ssgd among the"
        " candidates"
    )
  return Advice(
      tuple(rows),
      pick,
      calibration,
      workers,
      link,
      global_batch,
      measurements,
      run_steps,
      run_repeats,
  )


def choose(
    rows: Sequence[Row], errors: Mapping[str, float], calibration: Calibration
) -> tuple[Row | None, Row | None]:
  """The advice's pick among ``rows`` (fastest first, by ``Row.seconds``),
  given the ``errors`` measured so far by name: of the candidates within
  the threshold that tie with the fastest of them (``Row.ties``), the one
  of least error (the fastest on a tie). Returns ``(pick, None)``;
  ``(None, row)`` where the choice needs the error of ``row``, not
  measured; ``(None, None)`` where no candidate is within the threshold."""
  fastest = None
  for row in rows:
    if fastest is not None and not row.ties(fastest):
      break
    error = errors.get(row.candidate.name)
    if error is None:
      return None, row
    if fastest is None and calibration.admits(error):
      fastest = row
  if fastest is None:
    return None, None
  tied = [
      r
      for r in rows[rows.index(fastest) :]
      if r.ties(fastest) and calibration.admits(errors[r.candidate.name])
  ]
  return min(tied, key=lambda r: errors[r.candidate.name]), None


def advise(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batches: Sequence[Any],
    *,
    workers: int,
    link: Link,
    candidates: Sequence[Candidate] | None = None,
    max_gap: float = MAX_GAP,
    overlap: bool = False,
    measurements: Measurements | None = None,
    measure_all: bool = False,
    warmup: int = WARMUP,
    short_runs: ShortRuns | None = None,
    progress: Callable[[str], None] | None = None,
) -> Advice:
  """Which compressor, at which rank, for this model on this link.

  Args:
    loss_fn: ``(params, batch) -> scalar loss`` of one worker's batch.
    params: the parameters (the initial ones, or a checkpoint's).
    batches: global batches, one a step (at least ``warmup + 1``; the
      calibration's measurement took ``STEPS``), each leaf's rows split
      evenly over the ``workers``.
    workers: the number of data-parallel workers.
    link: each worker's link.
    candidates: default ``default_candidates()``: every method, ranks 1 to 32.
    max_gap: the held-out loss gap to S-SGD the threshold promises (0.1:
      10 %), per the convergence records (``Calibration``).
    overlap: whether the runtime hides communication behind backprop
      (GPUs can; XLA:CPU does not).
    measurements: what ``measure`` returns, to skip measuring (the advice
      is then the same for the same inputs).
    measure_all: measure every candidate's error, not only those of the
      candidates predicted faster than the pick, and the pick's.
    warmup: dense steps before the errors are taken (see ``measure``;
      the calibration's measurement took ``WARMUP``).
    short_runs: with them, every error is measured, then S-SGD and each
      candidate within the threshold train these short runs
      (``steps.ShortRuns``), and the advice ranks by the time to S-SGD's
      loss, each step's time times the candidate's steps per S-SGD step.
    progress: called with a line before each measurement.

  Returns:
    The ``Advice``: rows fastest first, the pick, and ``compressor()``.

  Example::

    from acp_jax_tools import advice as advice_lib

    advice = acp_jax.advise(
        loss_fn, params, [batch0, batch1, batch2, batch3], workers=8,
        link=advice_lib.Link(bandwidth=125e6, latency=50e-6),
    )
    print(advice.table())
    tx = acp_jax.chain(advice.compressor(warmup_steps=60), optax.adamw(1e-3))
  """
  _checks.integer("workers", workers, 1)
  if not isinstance(link, Link):
    raise TypeError(
        f"link must be an acp_jax_tools.advice.Link, got {link!r}"
    )
  candidates = tuple(candidates or default_candidates())
  calibration = Calibration.recorded(max_gap)
  measure_all = measure_all or short_runs is not None
  first = jax.tree.leaves(batches[0]) if len(batches) else []
  if not first:
    raise ValueError(f"batches must hold at least one batch, got {batches!r}")
  global_batch = first[0].shape[0]
  sent = volumes(candidates, params, workers)
  if measurements is None:
    _warn_unless_as_calibrated(warmup, len(batches))

    def ranked(timed):
      return _ranked(
          timed, sent, candidates, workers, link, global_batch, overlap
      )

    ranking = None if measure_all else (ranked, calibration)
    measurements = _measure_ranked(
        loss_fn, params, batches, candidates, workers, warmup, progress, ranking
    )
  if short_runs is not None and not measurements.steps:
    error = measurements.error_to_noise
    admitted = [c for c in candidates if calibration.admits(error[c.name])]
    steps, steps_range = short_runs.measure(
        loss_fn, params, admitted, workers=workers, progress=progress
    )
    measurements = dataclasses.replace(
        measurements, steps=steps, steps_range=steps_range
    )
  return recommend(
      measurements,
      sent,
      candidates,
      workers=workers,
      link=link,
      global_batch=global_batch,
      calibration=calibration,
      overlap=overlap,
      run_steps=len(short_runs.batches) if short_runs else 0,
      run_repeats=short_runs.repeats if short_runs else 0,
  )


def _measure_ranked(
    loss_fn, params, batches, candidates, workers, warmup, progress, ranking
) -> Measurements:
  """``measure``'s measurements of ``candidates``; with ``ranking``, a
  ``(rank, calibration)`` pair, the errors in the order ``rank`` (its
  measurements -> rows) gives, until ``choose`` is sure of the pick."""
  kwargs = {"workers": workers, "warmup": warmup, "progress": progress}
  if ranking is None:
    return measure(loss_fn, params, batches, candidates, **kwargs)
  rank, calibration = ranking
  rows = []

  def order(timed):
    rows[:] = rank(timed)
    return [r.candidate for r in rows]

  def enough(errors):
    return choose(rows, errors, calibration)[0] is not None

  return measure(
      loss_fn, params, batches, candidates, order=order, enough=enough, **kwargs
  )


def _warn_unless_as_calibrated(warmup: int, steps: int) -> None:
  """Warns unless the errors are measured over the steps the threshold's
  were: ``STEPS`` batches, the first ``WARMUP`` dense."""
  if (warmup, steps) != (WARMUP, STEPS):
    warnings.warn(
        f"the threshold was calibrated on errors over {STEPS - WARMUP}"
        f" steps after {WARMUP} dense ones, these are over"
        f" {steps - warmup} after {warmup}: the errors grow as"
        " compressed steps add up, so the threshold does not apply as"
        f" calibrated (give {STEPS} batches and warmup={WARMUP})",
        stacklevel=3,
    )
