"""The advice checked against the shaped-link measurements: at each point of
the cluster sweep (examples/s) and of the time-to-quality runs (seconds to
S-SGD's quality), what ``acp_jax.advise`` picks among the methods measured
there, beside the measured best (the report's sections and its targets
read it)."""

import functools
import statistics
from typing import Any

from acp_jax import registry
from acp_jax_tools import advice as advice_lib
from benchmarks import convergence
from benchmarks import launch
from benchmarks import records
from benchmarks import report_quality
from benchmarks import workloads
from train import experiment as experiment_lib

# The links of the sweep the advice is checked on: 1 Gb/s and slower.
ADVICE_LINKS = ("10mbit", "100mbit", "1gbit")


def advice_at(point, link, errors, params) -> dict[str, Any]:
  """The advice at one measured ``point`` (its rows of acp_jax's methods),
  from the point's measured ``link`` record, its local steps and the
  ``errors`` (``error_to_noise``) the advice measured on the same model and
  workers, restricted to the methods measured there; beside the measured
  best."""
  rank = workloads.CLUSTER_MODELS[point[0]["model"]]["rank"]
  measured = {}
  for r in point:
    c = r["compressor"]
    candidate = advice_lib.Candidate(
        c, rank if c in registry.low_rank() else None
    )
    measured[candidate] = r
  fastest_local = min(r["step_local_s"] for r in measured.values())
  names = {c.name: r for c, r in measured.items()}
  workers = point[0]["workers"]
  calibration = advice_lib.Calibration.recorded()
  speed = {n: r["examples_per_sec"] for n, r in names.items()}
  best = max(speed, key=speed.get)
  row = {
      "workers": workers,
      "bandwidth": point[0]["bandwidth"],
      "best": best,
      "best_examples_per_sec": speed[best],
  }
  eligible = [n for n in speed if calibration.admits(errors[n])]
  if not eligible:
    return {**row, "advised": "none within the threshold"}
  advice = advice_lib.recommend(
      advice_lib.Measurements(
          fastest_local,
          {n: r["step_local_s"] - fastest_local for n, r in names.items()},
          {n: errors[n] for n in names},
      ),
      advice_lib.volumes(measured, params, workers),
      tuple(measured),
      workers=workers,
      link=advice_lib.Link(1 / link["beta_s_per_byte"], link["alpha_s"]),
      global_batch=workers * workloads.CLUSTER_MODELS[point[0]["model"]][
          "batch_size"
      ],
      calibration=calibration,
  )
  advised = advice.pick.candidate.name
  best_eligible = max(eligible, key=speed.get)
  return {
      **row,
      "advised": advised,
      "advised_examples_per_sec": speed[advised],
      "ratio": speed[advised] / speed[best],
      "best_eligible": best_eligible,
      "eligible_ratio": speed[advised] / speed[best_eligible],
  }


def points(rows, links, advice) -> tuple[list[dict[str, Any]], list[str]]:
  """``advice_at`` at each point of the sweep's ``rows`` (acp_jax's methods,
  ``ADVICE_LINKS``), given the calibrated ``links`` records and the
  ``advice`` records, fewest workers and slowest link first; and the models
  and worker counts that no advice record covers."""
  errors = {}
  for r in advice:
    key = r["model"], r["workers"]
    errors.setdefault(key, {})[r["name"]] = r["error_to_noise"]
  by_point = {}
  for r in rows:
    if r["system"] == "acp_jax" and r["bandwidth"] in ADVICE_LINKS:
      by_point.setdefault((r["bandwidth"], r["workers"]), []).append(r)
  linked = {(r["bandwidth"], r["workers"]): r for r in links}
  checked, missing = [], []
  for (bandwidth, workers), point in sorted(
      by_point.items(), key=lambda kv: (kv[0][1], _mbit(kv[0][0]))
  ):
    key = (point[0]["model"], workers)
    if key not in errors:
      missing.append(f"{key[0]} on {workers} workers")
      continue
    checked.append(
        advice_at(
            point,
            linked[bandwidth, workers],
            errors[key],
            cluster_params(key[0]),
        )
    )
  return checked, missing


def _mbit(bandwidth: str) -> float:
  return launch.BANDWIDTHS[bandwidth] or float("inf")


@functools.cache
def cluster_params(model: str):
  """The abstract params of cluster workload ``model``."""
  return experiment_lib.build(
      workloads.cluster_config(model, "ssgd", 1)
  ).abstract_params


def _candidate(task: str, variant: str) -> str:
  """The advice's name of a convergence variant's compressor."""
  v = convergence.VARIANTS[variant]
  return advice_lib.Candidate(
      v.compressor, convergence.rank(task, variant), v.comm_dtype
  ).name


def quality_points(rows, curves, links, advice) -> list[dict[str, Any]]:
  """At each point of the time-to-quality runs (a run's task, workers and
  link; its methods of one dense warm-up and S-SGD), the advice's pick
  among the methods measured there, and its seconds to the target over the
  fastest method's, round by round.

  The pick is the advice's among them (``advice_lib.choose``), from the
  latest ``advice`` record (``--measure_all``) of the point's task and
  workers for its link, as the calibrated ``links`` record fits it, made
  on the run's machine: ranked by the advice, fastest first (by the time
  to S-SGD's loss where its short runs measured the steps). Points with no
  such record are left out."""
  by_advice = {}
  for record in records.by_run([r for r in advice if r["bandwidth"]]):
    here = {}
    for r in record:
      key = r["machine"], r["model"], r["workers"], round(r["bandwidth"])
      here.setdefault(key, []).append(r)
    by_advice.update(here)  # a later record of a point replaces an earlier
  fits = {(r["bandwidth"], r["workers"]): r for r in links}
  out = []
  for run in records.by_run(report_quality.with_startup(rows, curves)):
    points = {}
    # The advice picks among acp_jax's methods, not PyTorch DDP's.
    run = [r for r in run if r["variant"] in convergence.VARIANTS]
    for r in run:
      warmups = [convergence.VARIANTS[r["variant"]].warmup]
      if r["variant"] == "ssgd":
        warmups = {convergence.VARIANTS[x["variant"]].warmup for x in run}
      for w in warmups:
        key = r["task"], r["workers"], r["bandwidth"], w
        points.setdefault(key, []).append(r)
    for (task, workers, bandwidth, warmup), here in points.items():
      fit = fits.get((bandwidth, workers))
      ranked = fit and by_advice.get((
          here[0]["machine"],
          task,
          workers,
          round(1 / fit["beta_s_per_byte"]),
      ))
      if not ranked or len(here) < 2:
        continue
      out.append(
          _quality_point(task, workers, bandwidth, warmup, here, ranked)
      )
  return out


def _short_runs(record: dict[str, Any]) -> str:
  """The short runs an advice record's steps come from, in words."""
  steps = record.get("run_steps")
  if not steps:
    return "none"
  return f"{record['run_repeats']} x {steps} steps"


def _quality_point(task, workers, bandwidth, warmup, here, ranked):
  """``quality_points``' row of one point: its ``here`` records and the
  advice's ``ranked`` rows for its link."""
  names = {_candidate(task, r["variant"]): r for r in here}
  seconds = {n: report_quality.round_seconds(r) for n, r in names.items()}
  rounds = min(len(s) for s in seconds.values())
  median = {n: statistics.median(s) for n, s in seconds.items()}
  fastest = min(median, key=median.get)
  row = {
      "task": task,
      "workers": workers,
      "bandwidth": bandwidth,
      "warmup": warmup,
      "fastest": fastest,
      "fastest_s": median[fastest],
      "short_runs": _short_runs(ranked[0]),
      "machine": here[0]["machine"],
      "date": here[0]["date"],
  }
  rows = [advice_lib.Row.from_dict(r) for r in ranked if r["name"] in names]
  errors = {
      r.candidate.name: r.error_to_noise
      for r in rows
      if r.error_to_noise is not None
  }
  first = ranked[0]
  pick, _ = advice_lib.choose(
      rows,
      errors,
      advice_lib.Calibration(
          first["threshold"], first["max_gap"], (), first["calibration"]
      ),
  )
  if pick is None:
    return {**row, "advised": "none within the threshold"}
  pick = pick.candidate.name
  each = [
      seconds[pick][i] / min(s[i] for s in seconds.values())
      for i in range(rounds)
  ]
  return {
      **row,
      "advised": pick,
      "advised_s": median[pick],
      "ratio": median[pick] / median[fastest],
      "ratio_max": max(each),
  }
