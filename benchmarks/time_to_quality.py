"""Time to quality: how soon each method reaches S-SGD's held-out loss.

A method's time to a target is its steps to the target times its step time
on a link; with a dense warm-up, its first steps at S-SGD's step time as it
ran them (``composed``). Steps come from convergence curves (several seeds,
simulated devices); a step time from the cluster (the median of interleaved
runs on a shaped link). Where a point also runs end to end (the trainer's
``target_eval_loss``, across the link), the composed figure must lie within
``COMPOSED_VS_DIRECT`` of it: ``agrees`` is that check.

The targets come from S-SGD's own curves: the held-out loss that every one
of its seeds has reached at its last evaluation ("S-SGD's quality", what a
user who trains as long with S-SGD is sure to get; the worst seed's, so that
S-SGD itself reaches it in every seed), and at half its steps (a looser one,
where the curves still fall fast and a rougher method may arrive first).
"""

from collections.abc import Iterable, Sequence
import math
import statistics
from typing import Any, NamedTuple

from benchmarks.thresholds import COMPOSED_VS_DIRECT

# {seed: {step: held-out loss}}
Curves = dict[int, dict[int, float]]


class Span(NamedTuple):
  """A figure over seeds or rounds: its median and range. ``math.inf``
  stands for a seed that never reached the target within its steps."""

  median: float
  low: float
  high: float

  @classmethod
  def of(cls, values: Iterable[float]) -> "Span":
    values = list(values)
    if not values:
      raise ValueError("a span of no values")
    return cls(statistics.median(values), min(values), max(values))


def curves(records: Sequence[dict[str, Any]], task: str) -> dict[str, Curves]:
  """The held-out loss curves of ``task``'s convergence records
  (``convergence_curves.json``), by variant and seed."""
  out = {}
  for r in records:
    if r["task"] == task and r.get("eval_loss") is not None:
      seed_curve = out.setdefault(r["variant"], {}).setdefault(r["seed"], {})
      seed_curve[r["step"]] = r["eval_loss"]
  return out


def worst_at(seeds: Curves, step: int) -> float:
  """The highest held-out loss over seeds evaluated at ``step``."""
  missing = [seed for seed, curve in seeds.items() if step not in curve]
  if missing:
    raise ValueError(f"seeds {missing} have no evaluation at step {step}")
  return max(curve[step] for curve in seeds.values())


def targets(ssgd: Curves) -> dict[str, tuple[int, float]]:
  """S-SGD's quality and a looser target, each as (S-SGD's step, loss): the
  worst seed's held-out loss at S-SGD's last evaluation, and at the
  evaluation nearest half of it (the earlier of two as near)."""
  steps = sorted(set.intersection(*(set(c) for c in ssgd.values())))
  if not steps:
    raise ValueError("S-SGD's seeds share no evaluation step")
  last = steps[-1]
  half = min(steps, key=lambda s: (abs(s - last / 2), s))
  return {
      "ssgd_final": (last, worst_at(ssgd, last)),
      "ssgd_half": (half, worst_at(ssgd, half)),
  }


def steps_to(curve: dict[int, float], target: float) -> float:
  """The first evaluated step whose held-out loss is at most ``target``;
  ``math.inf`` where none is (the run's cap came first)."""
  return min((s for s, loss in curve.items() if loss <= target),
             default=math.inf)


def composed(
    steps: float, step_seconds: float, warmup: int = 0, dense: float = 0.0
) -> float:
  """Seconds of ``steps`` steps at ``step_seconds`` each, but the first
  ``warmup``, a dense warm-up's, at ``dense`` each."""
  first = min(steps, warmup)
  rest = (steps - first) * step_seconds if steps > first else 0.0
  return first * dense + rest


def phase_step_seconds(
    curve: Sequence[tuple[int, float]], warmup: int
) -> tuple[float, float]:
  """A run's seconds per step in its dense warm-up and after it, from its
  ``(step, training seconds)`` at each evaluation: the median over the
  intervals between evaluations that lie within its first ``warmup``
  steps, and over those after them. The interval up to the first
  evaluation (the first program's compilation) and one across the switch
  (the compressing program's) are left out; ``math.nan`` where no interval
  is left."""
  points = sorted(curve)
  dense, compressed = [], []
  for (s0, t0), (s1, t1) in zip(points, points[1:]):
    if s1 <= warmup:
      dense.append((t1 - t0) / (s1 - s0))
    elif s0 >= warmup:
      compressed.append((t1 - t0) / (s1 - s0))
  median = lambda xs: statistics.median(xs) if xs else math.nan
  return median(dense), median(compressed)


def agrees(composed: float, direct: float) -> bool:
  """Whether a composed time to target lies within ``COMPOSED_VS_DIRECT``
  of the same point run end to end, on either side."""
  if not (math.isfinite(composed) and direct > 0 and math.isfinite(direct)):
    return False
  return abs(composed / direct - 1) <= COMPOSED_VS_DIRECT


def table(
    records: Sequence[dict[str, Any]], task: str
) -> list[dict[str, Any]]:
  """Each variant of ``task`` against S-SGD's targets: steps and bytes to
  each target, medians over seeds with their range, and how many seeds
  reached it. Bytes to a target are those the variant sent up to that
  step, its warm-up's included."""
  by_variant = curves(records, task)
  if "ssgd" not in by_variant:
    return []
  sent = {
      (r["variant"], r["seed"], r["step"]): r["bytes_sent"]
      for r in records
      if r["task"] == task and r.get("eval_loss") is not None
  }
  rows = []
  for name, (ssgd_step, loss) in targets(by_variant["ssgd"]).items():
    for variant, seeds in by_variant.items():
      each = {seed: steps_to(c, loss) for seed, c in seeds.items()}
      steps = Span.of(each.values())
      reached = [s for s, n in each.items() if math.isfinite(n)]
      rows.append({
          "task": task,
          "target": name,
          "target_loss": loss,
          "ssgd_step": ssgd_step,
          "variant": variant,
          "seeds": len(seeds),
          "reached": len(reached),
          "steps": steps,
          "bytes": Span.of(
              sent[variant, s, each[s]] if s in reached else math.inf
              for s in seeds
          ),
      })
  return rows
