"""How many steps a compressor takes per S-SGD step to the same loss, from
short runs of each (``acp_jax.advise``'s ``short_runs``).

At the same error, the char LM lost 8 % of held-out loss and the BERT MLM
0.4 %, so an error threshold cannot tell whether a faster, rougher method
arrives first. Short runs measure how much slower each candidate descends
on this model, with this optimizer, and the advice multiplies each step's
time by it. They are early in training, so they predict the later gap only
as far as the gap holds its size.
"""

from collections.abc import Callable, Sequence
import dataclasses
import itertools
import math
import statistics
from typing import Any

import jax
import numpy as np
import optax

from acp_jax import _checks
from acp_jax_tools.candidates import Candidate
from acp_jax_tools.measure import run_losses

# The fewest steps of a short run, and how many times a run takes the
# held-out loss (every step where it takes fewer).
RUN_STEPS_MIN = 8
RUN_EVALS = 20


@dataclasses.dataclass(frozen=True)
class ShortRuns:
  """Short runs of S-SGD and each candidate: from the params, a step a
  batch of ``batches`` (shuffled as training would, at least
  ``RUN_STEPS_MIN``) with ``optimizer`` after the candidate's compressed
  mean, their loss on ``eval_batches`` taken ``RUN_EVALS`` times; each
  ``repeats`` times, the batches in the given order and then shuffled by
  seeds 1, 2, ... (one run's steps carry the luck of its batches'
  order)."""

  optimizer: optax.GradientTransformation
  batches: Sequence[Any]
  eval_batches: Sequence[Any]
  repeats: int = 1

  def __post_init__(self):
    if len(self.batches) < RUN_STEPS_MIN:
      raise ValueError(
          f"short_runs.batches must hold at least {RUN_STEPS_MIN} batches,"
          f" got {len(self.batches)}"
      )
    if not self.eval_batches:
      raise ValueError(
          "short_runs.eval_batches must hold at least one held-out batch,"
          f" got {self.eval_batches!r}"
      )
    _checks.integer("short_runs.repeats", self.repeats, 1)

  def measure(
      self,
      loss_fn: Callable[[Any, Any], jax.Array],
      params: Any,
      candidates: Sequence[Candidate],
      *,
      workers: int,
      progress: Callable[[str], None] | None = None,
  ) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Each candidate's steps per S-SGD step to the same held-out loss
    (``steps_behind``), by name, the median over the repeats; and each
    one's lowest and highest. S-SGD's is 1."""
    _checks.integer("workers", workers, 1)
    say = progress or (lambda line: None)
    every = max(1, len(self.batches) // RUN_EVALS)
    reference = Candidate("ssgd")
    runs = list(dict.fromkeys((reference, *candidates)))
    steps = {c.name: [] for c in runs}
    for seed in range(self.repeats):
      order = np.random.default_rng(seed).permutation(len(self.batches))
      batches = [self.batches[i] for i in order] if seed else self.batches
      losses = {}
      for i, c in enumerate(runs):
        say(
            f"[{i + 1}/{len(runs)}] {len(batches)} steps of {c.name}, order"
            f" {seed + 1} of {self.repeats}"
        )
        losses[c.name] = run_losses(
            loss_fn,
            params,
            batches,
            self.eval_batches,
            c,
            self.optimizer,
            workers=workers,
            every=every,
        )
      for c in runs:
        behind = steps_behind(losses[c.name], losses[reference.name])
        steps[c.name].append(behind)
    return (
        {name: statistics.median(s) for name, s in steps.items()},
        {name: (min(s), max(s)) for name, s in steps.items()},
    )


def steps_behind(losses: Sequence[float], reference: Sequence[float]) -> float:
  """The steps a short run takes per step of the ``reference`` run's to the
  same held-out loss: 1 for a run as good as the reference, 2 for one that
  needs twice its steps.

  Both lists are held-out losses on the same batches, at the same evenly
  spaced steps from the start (``run_losses``), each read as its best loss
  so far. The run's curve is read as the reference's, stretched in steps
  by a factor ``f``: its mean over the last quarter of the evaluations
  (the mean, so that one evaluation's noise counts less) equals the
  reference's mean over the same steps divided by ``f``, interpolated
  linearly between evaluations. A run ahead of the reference counts as 1
  (a compressed mean follows the true one, it does not outrun it); one
  whose loss the reference never came down to within the run, as
  ``math.inf``.
  """
  if len(losses) != len(reference) or len(losses) < 5:
    raise ValueError(
        "losses and reference must be evaluations at the same steps, at"
        f" least 5, got {len(losses)} and {len(reference)}"
    )
  best = list(itertools.accumulate(reference, min))
  last = range(len(losses) - max(2, len(losses) // 4), len(losses))
  own_best = list(itertools.accumulate(losses, min))
  level = statistics.fmean(own_best[i] for i in last)

  def reference_level(f):  # its mean over those steps, stretched by f
    return statistics.fmean(_interpolate(best, i / f) for i in last)

  if reference_level(1.0) >= level:
    return 1.0
  high = float(last[-1])  # every stretched step within the first interval
  if reference_level(high) < level:
    return math.inf
  low = 1.0
  while high - low > 1e-4 * low:  # bisection: the level falls as f grows
    mid = (low + high) / 2
    low, high = (mid, high) if reference_level(mid) < level else (low, mid)
  return (low + high) / 2


def _interpolate(curve: Sequence[float], x: float) -> float:
  """``curve`` at the fractional index ``x``, linear between its points."""
  i = min(int(x), len(curve) - 2)
  return curve[i] + (x - i) * (curve[i + 1] - curve[i])
