"""The report's time to quality: how soon each method reaches S-SGD's
held-out loss across the shaped link (``python -m benchmarks quality``),
and the README's table of it.

A method is faster to quality than S-SGD by the ratio of S-SGD's seconds to
its own, paired round by round (the rounds interleave the methods); a
round that did not reach the target within its step cap counts as never.
"""

import math
import pathlib
import statistics
from typing import Any

from benchmarks import convergence
from benchmarks import launch
from benchmarks import plots
from benchmarks import quality
from benchmarks import records
from benchmarks import template
from benchmarks import thresholds
from benchmarks.template import fill

_COLUMNS = {
    "workers": "workers",
    "link": "link",
    "method": "method",
    "reached": "reached",
    "steps": "steps",
    "mb": "MB sent",
    "seconds": "seconds (range)",
    "sooner": "S-SGD / it (range)",
    "of_medians": "of medians",
    "composed": "composed s",
    "composed_agrees": "agrees",
}


# The overview's names of the tasks' models and optimizers.
WORKLOADS = {
    "char_lm_sgd": "char LM, momentum SGD",
    "char_lm": "char LM, AdamW",
    "mnist": "CNN (MNIST), momentum SGD",
}


def label(task: str, variant: str) -> str:
  """A variant as the report names it: ``ACP-SGD (r=8), 60 dense steps``,
  ``PyTorch DDP + PowerSGD hook (r=4)``."""
  v = quality.variant_spec(variant)
  name = plots.LABELS[v.compressor]
  if variant in quality.TORCH_VARIANTS:
    name = "PyTorch DDP" + (" + PowerSGD hook" if v.rank_factor else "")
  if v.rank_factor:
    name += f" (r={v.rank_factor * convergence.rank(task, 'power_sgd')})"
  if v.comm_dtype:
    name += f", {v.comm_dtype}"
  if v.warmup:
    name += f", {v.warmup} dense steps"
  return name


def round_seconds(r: dict[str, Any]) -> list[float]:
  """Each round's seconds to the target: trained to it, or, for a variant
  that was only composed, its start-up (``startup_seconds``, where the
  report found it) and its steps to it times the round's step time."""
  key = "composed_seconds" if r.get("composed_only") else "train_seconds"
  values = records.runs(r, key) or [r[key]]
  startup = r.get("startup_seconds") or [0.0] * len(values)
  return [
      math.inf if x is None else x + s for x, s in zip(values, startup)
  ]


def with_startup(
    run: list[dict[str, Any]], curves: list[dict[str, Any]]
) -> list[dict[str, Any]]:
  """``run``'s records, each composed-only one with ``startup_seconds``:
  per round, what its first evaluation took beyond its steps at the round's
  step time (compilation, mostly), which the trained variants' seconds
  include. Its steps are all alike, so the step time prices them."""
  out = []
  for r in run:
    if r.get("composed_only"):
      firsts = {}
      for p in curves:
        if (
            (p["workers"], p["bandwidth"], p["variant"], p["date"])
            == (r["workers"], r["bandwidth"], r["variant"], r["date"])
            and p["round"] not in firsts
        ):
          firsts[p["round"]] = p
      steps = records.runs(r, "step_s")
      r = {
          **r,
          "startup_seconds": [
              max(firsts[i + 1]["train_seconds"] - firsts[i + 1]["step"] * s, 0)
              for i, s in enumerate(steps)
          ],
      }
    out.append(r)
  return out


def sooner(r: dict[str, Any], ssgd: dict[str, Any]) -> list[float]:
  """S-SGD's seconds to the target over ``r``'s, round by round (0 where
  ``r`` did not reach it, math.inf where S-SGD did not)."""
  return [
      b / a if math.isfinite(a) else 0.0
      for a, b in zip(round_seconds(r), round_seconds(ssgd))
  ]


def of_medians(r: dict[str, Any], ssgd: dict[str, Any]) -> float:
  """S-SGD's median seconds to the target over ``r``'s (0 where ``r``'s
  median round did not reach it), to print beside the median of the
  rounds' ratios (``sooner``)."""
  mine = statistics.median(round_seconds(r))
  if not math.isfinite(mine):
    return 0.0
  return statistics.median(round_seconds(ssgd)) / mine


def _span(values: list[float], digits: str) -> str:
  if not values or not any(math.isfinite(v) and v > 0 for v in values):
    return "not reached"
  shown = lambda x: format(x, digits) if math.isfinite(x) else "never"
  low, high = min(values), max(values)
  if low == high:
    return shown(statistics.median(values))
  return (
      f"{shown(statistics.median(values))} ({shown(low)}–{shown(high)})"
  )


def rows(run: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The table's rows of one run: each (workers, link, variant)."""
  ssgd = {
      (r["workers"], r["bandwidth"]): r for r in run if r["variant"] == "ssgd"
  }
  out = []
  for r in run:
    base = ssgd.get((r["workers"], r["bandwidth"]))
    ratios = sooner(r, base) if base and r is not base else []
    out.append({
        "workers": r["workers"],
        "link": plots.link_label(r["bandwidth"]),
        "method": label(r["task"], r["variant"])
        + (" (composed)" if r.get("composed_only") else ""),
        "reached": r["reached"],
        "steps": r["steps"],
        "mb": None if r.get("composed_only") else r["bytes_sent"] / 1e6,
        "seconds": _span(round_seconds(r), ".0f"),
        "sooner": _span(ratios, ".2f") if ratios else "",
        "of_medians": _span([of_medians(r, base)], ".2f") if ratios else "",
        # Records made before the rule priced a dense warm-up's steps
        # apart timed every step alike: their composition is left out.
        **(
            {}
            if r.get("composed_only")
            or r.get("composed_warmup", 0)
            != quality.variant_spec(r["variant"]).warmup
            else {
                "composed": r.get("composed_seconds"),
                "composed_agrees": r.get("composed_agrees"),
            }
        ),
    })
  return out


def fastest_every_round(
    run: list[dict[str, Any]], workers: int, bandwidth: str
) -> str | None:
  """The variant that reached the target first in every round on a link,
  or None where none did."""
  here = [
      r for r in run if (r["workers"], r["bandwidth"]) == (workers, bandwidth)
  ]
  rounds = min(len(round_seconds(r)) for r in here)
  firsts = {
      min(here, key=lambda r: round_seconds(r)[i])["variant"]
      for i in range(rounds)
  }
  return firsts.pop() if len(firsts) == 1 else None


def _reading(run: list[dict[str, Any]]) -> str:
  """Per link, the method first to the target in every round, if any."""
  points = dict.fromkeys((r["workers"], r["bandwidth"]) for r in run)
  said = []
  for workers, bandwidth in points:
    first = fastest_every_round(run, workers, bandwidth)
    where = f"{plots.link_label(bandwidth)} with {workers} workers"
    said.append(
        f"{where}, {label(run[0]['task'], first)} in every round"
        if first
        else f"{where}, no method in every round"
    )
  return template.and_list(said)


def _plot(run, curves, path: pathlib.Path) -> str:
  """The run's held-out curves against training seconds into ``path``;
  its Markdown image, or "" where the curves were not kept."""
  mine = {(r["workers"], r["bandwidth"], r["variant"]) for r in run}
  points = [
      {
          **p,
          "compressor": quality.variant_spec(p["variant"]).compressor,
          "thick": quality.variant_spec(p["variant"]).rank_factor == 2,
          "dashed": p["variant"] in quality.TORCH_VARIANTS,
      }
      for p in curves
      if (p["workers"], p["bandwidth"], p["variant"]) in mine
      and p["date"] == run[0]["date"]
  ]
  if not points:
    return ""
  plots.quality(points, run[0]["target_loss"], path)
  return f"![held-out loss against training seconds]({path.name})"


def seeds_said(run: list[dict[str, Any]]) -> str:
  """Which seeds the rounds of ``run`` trained, as its table says it
  (records made before the rounds took seeds of their own trained seed 0
  in each)."""
  seeds = records.runs(run[0], "seed") or [run[0].get("seed", 0)]
  if len(set(seeds)) == 1:
    return (
        f"every round trained seed {seeds[0]}, so the rounds differ in"
        " timing, not in training"
    )
  return "rounds trained seeds " + ", ".join(map(str, seeds))


def quality_section(
    rows_: list[dict[str, Any]], curves: list[dict[str, Any]], out: pathlib.Path
) -> list[str]:
  """A table per run of ``quality.json``, and its curves drawn into
  ``out``."""
  rows_ = with_startup(rows_, curves)
  blocks = [
      fill(
          "quality",
          tolerance=thresholds.COMPOSED_VS_DIRECT,
          overview=overview_table(rows_),
      )
  ]
  for i, run in enumerate(records.by_run(rows_), 1):
    blocks.append(
        fill(
            "quality_run",
            provenance=template.provenance(run),
            task=run[0]["task"],
            target=run[0]["target_loss"],
            seeds=seeds_said(run),
            table=records.table(rows(run), _COLUMNS),
            first=_reading(run),
            plot=_plot(run, curves, out / f"quality_run{i}.png"),
        )
    )
  return blocks


def summary_table(rows_: list[dict[str, Any]]) -> str:
  """The README's table of one quality run: each method's seconds to the
  target per link and worker count (the median of its rounds) and how many
  times sooner than S-SGD (the median of the rounds' ratios); in bold, the
  method first to the target in every round, where one was. One run, so
  that a table mixes neither machines nor targets."""
  if len(records.by_run(rows_)) > 1:
    raise ValueError("summary_table takes one run's records")
  where = lambda r: (r["workers"], r["bandwidth"])
  columns = list(dict.fromkeys(map(where, rows_)))
  first = {c: fastest_every_round(rows_, *c) for c in columns}
  head = ["method"] + [
      f"{plots.link_label(b)}, {w} workers" for w, b in columns
  ]
  lines = [head, ["---"] + ["---:"] * len(columns)]
  ssgd = {where(r): r for r in rows_ if r["variant"] == "ssgd"}
  for variant in dict.fromkeys(r["variant"] for r in rows_):
    line = [label(rows_[0]["task"], variant)]
    for c in columns:
      r = next(
          (x for x in rows_ if where(x) == c and x["variant"] == variant),
          None,
      )
      if r is None:
        line.append("")
        continue
      seconds = statistics.median(round_seconds(r))
      text = f"{seconds:.0f} s" if math.isfinite(seconds) else "not reached"
      if r.get("composed_only"):
        text += " (composed)"
      if variant != "ssgd" and c in ssgd and math.isfinite(seconds):
        text += f", {statistics.median(sooner(r, ssgd[c])):.2f}×"
      line.append(f"**{text}**" if variant == first[c] else text)
    lines.append(line)
  return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _firsts(here: list[dict[str, Any]]) -> list[str]:
  """Each round's seed and first method on one link, with how many times
  sooner than S-SGD it got there (where S-SGD ran and it is not S-SGD)."""
  ssgd = next((r for r in here if r["variant"] == "ssgd"), None)
  seeds = records.runs(here[0], "seed")
  out = []
  for i in range(min(len(round_seconds(r)) for r in here)):
    best = min(here, key=lambda r: round_seconds(r)[i])
    text = f"{seeds[i]}: {label(best['task'], best['variant'])}"
    if ssgd is not None and best is not ssgd:
      text += f" {round_seconds(ssgd)[i] / round_seconds(best)[i]:.2f}×"
    out.append(text)
  return out


def overview_table(rows_: list[dict[str, Any]]) -> str:
  """The README's headline: a line for each point (task, workers, link) of
  the runs whose rounds trained seeds of their own, with the method first
  to the target in every round (or none) and each round's first, with how
  many times sooner than S-SGD it got there. Runs of one seed repeat one
  draw of the training, so they cannot say which method comes first."""
  head = [
      "model, optimizer",
      "workers",
      "link",
      "machine",
      "first in every round",
      "each round's seed: its first (× sooner than S-SGD)",
  ]
  points = []
  for run in records.by_run(rows_):
    if len(set(records.runs(run[0], "seed"))) < 2:
      continue
    for where in dict.fromkeys((r["workers"], r["bandwidth"]) for r in run):
      here = [r for r in run if (r["workers"], r["bandwidth"]) == where]
      first = fastest_every_round(run, *where)
      task = run[0]["task"]
      points.append((
          (list(WORKLOADS).index(task), where[0], launch.BANDWIDTHS[where[1]]),
          [
              WORKLOADS[task],
              str(where[0]),
              plots.link_label(where[1]),
              run[0]["machine"].split(" (")[0],
              label(task, first) if first else "none",
              "; ".join(_firsts(here)),
          ],
      ))
  lines = [head, ["---"] * len(head)]
  lines += [line for _, line in sorted(points, key=lambda p: p[0])]
  return "\n".join("| " + " | ".join(line) + " |" for line in lines)
