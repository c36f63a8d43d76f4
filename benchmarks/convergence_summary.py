"""The convergence runs' records and curves summarized: means and spreads
over seeds against S-SGD's, the steps to S-SGD's final loss, the loss at a
warm-up's switch and the gap to S-SGD at each evaluation.

Records and curve points are those ``benchmarks.convergence`` writes.
"""

import math
import statistics
from typing import Any

# An S-SGD run whose final held-out loss is within this fraction of its
# first evaluation's never left its starting plateau (momentum SGD on the
# char-LM stays on the unigram plateau from some initializations): its seed
# measures nothing of what compression costs, and is left out of its task.
PLATEAU_FRACTION = 0.05


def untrained_seeds(curves: list[dict[str, Any]]) -> set[tuple[str, int]]:
  """``(task, seed)`` of every S-SGD run that did not train
  (``PLATEAU_FRACTION``)."""
  evals: dict[tuple[str, int], list[tuple[int, float]]] = {}
  for c in curves:
    if c["variant"] == "ssgd" and c.get("eval_loss") is not None:
      evals.setdefault((c["task"], c["seed"]), []).append(
          (c["step"], c["eval_loss"])
      )
  out = set()
  for key, points in evals.items():
    points.sort()
    first, last = points[0][1], points[-1][1]
    if len(points) > 1 and last > (1 - PLATEAU_FRACTION) * first:
      out.add(key)
  return out


def without_untrained(
    finals: list[dict[str, Any]], curves: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[tuple[str, int]]]:
  """``finals`` and ``curves`` without the seeds of an S-SGD run that did
  not train (``untrained_seeds``), and those ``(task, seed)``: what the
  summary, the plot and the tables of the runs all read."""
  untrained = untrained_seeds(curves)
  kept = lambda r: (r["task"], r["seed"]) not in untrained
  return (
      [r for r in finals if kept(r)],
      [c for c in curves if kept(c)],
      untrained,
  )


def summarize(
    finals: list[dict[str, Any]], curves: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
  """Per task and variant: the mean and spread over seeds, against S-SGD's
  mean (accuracy in points, loss in %, as the targets put them), and with
  ``curves`` the steps-to-target ratio (``steps_to_target``) and the
  steps' cost of ending behind (``steps_cost``), the seeds of
  an S-SGD run that did not train left out (``untrained_seeds``; their
  count is ``seeds_left_out``)."""
  untrained = set()
  if curves is not None:
    finals, curves, untrained = without_untrained(finals, curves)
  groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for r in finals:
    groups.setdefault((r["task"], r["variant"]), []).append(r)
  rows = []
  for (task, variant), runs in groups.items():
    row = {
        k: runs[0].get(k)
        for k in (
            "task",
            "optimizer",
            "variant",
            "compressor",
            "compress",
            "rank",
            "comm_dtype",
            "warmup_steps",
            "steps",
            "bytes_per_step",
        )
    }
    row["seeds"] = len(runs)
    row["seeds_left_out"] = sum(t == task for t, _ in untrained)
    for key in ("eval_loss", "eval_accuracy", "bytes_sent", "wall_seconds"):
      values = [r[key] for r in runs]
      row[key] = statistics.mean(values)
      if key.startswith("eval"):
        row[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        row[key + "_min"], row[key + "_max"] = min(values), max(values)
    rows.append(row)
  base = {r["task"]: r for r in rows if r["variant"] == "ssgd"}
  for row in rows:
    ssgd = base.get(row["task"])
    if ssgd:
      row["accuracy_vs_ssgd_pts"] = 100 * (
          row["eval_accuracy"] - ssgd["eval_accuracy"]
      )
      row["loss_vs_ssgd_pct"] = 100 * (row["eval_loss"] / ssgd["eval_loss"] - 1)
  if curves is not None:
    for row in rows:
      row["steps_to_target_ratio"] = steps_to_target(
          curves, row["task"], row["variant"]
      )
      row["steps_cost"] = steps_cost(curves, row["task"], row["variant"])
  return rows


def _mean_curve(
    curves: list[dict[str, Any]], task: str, variant: str
) -> list[tuple[int, float]]:
  """``(step, held-out loss)`` of ``variant``, the mean over the seeds
  evaluated at that step, by step."""
  by_step: dict[int, list[float]] = {}
  for c in curves:
    if (c["task"], c["variant"]) == (task, variant) and c.get(
        "eval_loss"
    ) is not None:
      by_step.setdefault(c["step"], []).append(c["eval_loss"])
  return [(k, statistics.mean(v)) for k, v in sorted(by_step.items())]


def _first_step_at(curve: list[tuple[int, float]], target: float):
  """The step at which ``curve`` first reaches ``target`` (linear between
  evaluations), or None."""
  for (s0, l0), (s1, l1) in zip([(0, math.inf)] + curve, curve):
    if l1 <= target:
      if not math.isfinite(l0):
        return float(s1)
      return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
  return None


def steps_to_target(
    curves: list[dict[str, Any]], task: str, variant: str
) -> float | None:
  """The steps ``variant`` needs to reach S-SGD's final held-out loss
  (means over seeds), relative to the steps S-SGD needs for it; None if it
  does not reach it within its budget, or S-SGD did not run."""
  ssgd = _mean_curve(curves, task, "ssgd")
  if not ssgd:
    return None
  target = ssgd[-1][1]
  needed = _first_step_at(_mean_curve(curves, task, variant), target)
  if needed is None:
    return None
  return needed / _first_step_at(ssgd, target)


def steps_cost(
    curves: list[dict[str, Any]], task: str, variant: str
) -> float | None:
  """The steps ``variant`` took to its final held-out loss over the steps
  S-SGD needs to reach that loss (means over seeds): how many times the
  steps compression costs, where it ends behind S-SGD; None where it ends
  level or ahead, or S-SGD did not run."""
  ssgd = _mean_curve(curves, task, "ssgd")
  mine = _mean_curve(curves, task, variant)
  if not ssgd or not mine or mine[-1][1] <= ssgd[-1][1]:
    return None
  step, loss = mine[-1]
  return step / _first_step_at(ssgd, loss)


def stall(
    curves: list[dict[str, Any]],
    variant: str,
    warmup: int,
    task: str = "char_lm",
) -> dict[int, float]:
  """Mean train loss of ``variant`` over seeds at step ``warmup`` (a
  warm-up's switch) and 50 and 100 steps later, at the logged steps nearest
  to them, by step."""
  out = {}
  for offset in (0, 50, 100):
    target = warmup + offset
    by_seed = {}
    if not any(c["step"] >= target for c in curves if c["variant"] == variant):
      break  # past the end of the runs
    for c in curves:
      if (c["task"], c["variant"]) == (task, variant) and c.get(
          "loss"
      ) is not None:
        best = by_seed.get(c["seed"])
        if best is None or abs(c["step"] - target) < abs(best["step"] - target):
          by_seed[c["seed"]] = c
    if by_seed:
      out[target] = statistics.mean(c["loss"] for c in by_seed.values())
  return out


def gaps(
    curves: list[dict[str, Any]], task: str, variants: tuple[str, ...]
) -> list[dict[str, Any]]:
  """The held-out loss of each variant against S-SGD's at every evaluation
  (means over seeds), in %: whether a gap is closing within the budget."""
  means: dict[tuple[str, int], list[float]] = {}
  for c in curves:
    if c["task"] == task and c.get("eval_loss") is not None:
      means.setdefault((c["variant"], c["step"]), []).append(c["eval_loss"])
  steps = sorted({step for variant, step in means if variant == "ssgd"})
  rows = []
  for variant in variants:
    row = {"variant": variant}
    for step in steps:
      if (variant, step) in means:
        ratio = statistics.mean(means[variant, step]) / statistics.mean(
            means["ssgd", step]
        )
        row[f"step {step}"] = 100 * (ratio - 1)
    rows.append(row)
  return rows


COLUMNS = {
    "task": "task",
    "optimizer": "optimizer",
    "variant": "variant",
    "rank": "rank",
    "comm_dtype": "factors in",
    "warmup_steps": "dense steps",
    "seeds": "seeds",
    "seeds_left_out": "seeds left out",
    "eval_accuracy": "held-out accuracy",
    "eval_accuracy_std": "± (std)",
    "eval_loss": "held-out loss",
    "eval_loss_std": "± (std)",
    "accuracy_vs_ssgd_pts": "acc. vs S-SGD (pts)",
    "loss_vs_ssgd_pct": "loss vs S-SGD (%)",
    "steps_to_target_ratio": "steps to S-SGD's loss (x S-SGD's)",
    "steps_cost": "steps to its loss (x S-SGD's to it)",
    "bytes_per_step": "bytes/step",
    "bytes_sent": "bytes sent",
    "wall_seconds": "seconds",
}
# A closed experiment's runs also say what the compressor averaged (the
# gradient, or AdamW's first moment), as their records hold it.
CLOSED_COLUMNS = {
    k: v
    for key, label in COLUMNS.items()
    for k, v in (
        ((key, label), ("compress", "compresses"))
        if key == "variant"
        else ((key, label),)
    )
}
