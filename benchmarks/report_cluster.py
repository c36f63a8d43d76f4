"""The report's sections on clusters: the one on shaped links, the projection
to the paper's clusters and hierarchical compression across nodes (with the
model sharded within a node, where that ran).

The prose is ``report_template.md``'s; the fields come from the records and
from the constants of the code that the prose names.
"""

import fractions
import pathlib
import re
import statistics
from typing import Any

from acp_jax import registry
from acp_jax_tools import advice as advice_lib
from acp_jax_tools import costmodel
from benchmarks import advice_check
from benchmarks import cluster
from benchmarks import consistency
from benchmarks import convergence
from benchmarks import plots
from benchmarks import project
from benchmarks import records
from benchmarks import targets
from benchmarks import thresholds
from benchmarks import template
from benchmarks import workloads
from benchmarks.template import fill
from train import models

_STEP_PARTS_COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "compressor": "compressor",
    "step": "step",
    "phase0": "step, phase 1",
    "phase1": "step, phase 2",
    "compute": "compute only",
    "forward_backward": "forward+backward",
    "compression": "arithmetic",
    "collectives": "collectives",
    "optimizer": "optimizer",
    "dispatch": "dispatch",
    "comm": "model comm",
    "error_pct": "model error, %",
    "comm_busy": "model comm, busy link",
}
# A part that the measurement cannot take apart from the others: the
# compressor on the cluster took less than its arithmetic alone.
NOT_APART = "not apart"
_RATIO_COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "compute_ms": "compute, ms",
    "link_ms": "S-SGD's all-reduce, ms",
    "ratio": "compute / link",
}
_LINKS_COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "alpha_us": "alpha idle, us",
    "mb_per_s": "1/beta idle, MB/s",
    "busy_alpha_us": "alpha busy, us",
    "busy_mb_per_s": "1/beta busy, MB/s",
}
_SPEEDUP_COLUMNS = {
    "bandwidth": "link",
    **{label: f"x {label}" for label, *_ in thresholds.CLUSTER_SPEEDUPS},
    "PyTorch DDP": "x PyTorch DDP",
}
_AVERAGES_COLUMNS = {
    "compute_source": "compute on",
    "compute_scale": "compute x",
    "acp_vs_ssgd": "x S-SGD",
    "paper_acp_vs_ssgd": "paper",
    "acp_vs_power_sgd": "x Power-SGD",
    "paper_acp_vs_power_sgd": "paper",
}
_HIERARCHICAL_COLUMNS = {
    "bandwidth": "link",
    "method": "method",
    "examples_per_sec": "examples/s",
    "slow_link_bytes_per_step": "bytes/step on the slow link",
    "node_axis_bytes_per_device": "node axis, per device",
    "local_axis_bytes_per_device": "local axis, per device",
    "params_identical": "same params",
}


def _cores(rows: list[dict[str, Any]]) -> int | None:
  """The cores of the machine the records name, if one machine and said."""
  counts = set()
  for r in rows:
    match = re.search(r"\((\d+) cores\)", r["machine"])
    if not match:
      return None
    counts.add(int(match[1]))
  return counts.pop() if len(counts) == 1 else None


def _binary_size(size: int) -> str:
  for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
    if size >= scale:
      return f"{size / scale:g} {unit}"
  return f"{size} bytes"


def _step_parts(r: dict[str, Any]) -> dict[str, Any]:
  """A JAX cluster record's step taken apart, in milliseconds. The
  collectives are the compressor on the cluster less its arithmetic alone,
  two programs timed apart: where that comes out negative, the collectives
  were too short to measure apart from the arithmetic, and say so."""
  ms = {k: 1e3 * v for k, v in r.items() if k.endswith("_s")}
  collectives = ms["compress_s"] - ms["compress_local_s"]
  return {
      "workers": r["workers"],
      "bandwidth": r["bandwidth"],
      "compressor": r["compressor"],
      "step": ms["step_s"],
      "phase0": ms.get("phase0_step_s"),
      "phase1": ms.get("phase1_step_s"),
      "compute": ms["step_local_s"],
      "forward_backward": ms["forward_backward_s"],
      "compression": ms["compress_local_s"],
      "collectives": collectives if collectives >= 0 else NOT_APART,
      "optimizer": ms["optimizer_s"],
      "dispatch": ms["dispatch_s"],
      "comm": ms["predicted_step_s"] - ms["step_local_s"],
      "comm_busy": ms["predicted_busy_step_s"] - ms["step_local_s"],
      "error_pct": r["error_pct"],
  }


def _taken_apart(mine) -> list[dict[str, Any]]:
  """The JAX records whose run also took the step apart."""
  return [r for r in mine if "compress_local_s" in r]


def _compute_to_link(mine, calibration) -> list[dict[str, Any]]:
  """Per worker count and link: S-SGD's compute-only step against its
  all-reduce on the link as calibrated, and their ratio. The compute does
  not depend on the link: its median over the links S-SGD ran on."""
  out = []
  for workers, group in targets.by_workers(mine).items():
    dense = [r for r in group if r["compressor"] == "ssgd"]
    if not dense:
      continue
    compute = statistics.median(r["step_local_s"] for r in dense)
    for row in _links([c for c in calibration if c["workers"] == workers]):
      link = costmodel.Link(row["alpha_us"] * 1e-6, 1e-6 / row["mb_per_s"])
      seconds = costmodel.all_reduce_seconds(
          dense[0]["bytes_per_step"], workers, link
      )
      out.append({
          "workers": workers,
          "bandwidth": row["bandwidth"],
          "compute_ms": 1e3 * compute,
          "link_ms": 1e3 * seconds,
          "ratio": compute / seconds,
      })
  return out


def _cluster_reading(mine) -> str:
  """Where ACP-SGD's step goes on the slowest link, computed."""
  text = []
  for r in mine:
    if r["compressor"] != "acp_sgd" or r["bandwidth"] != thresholds.SLOW_LINK:
      continue
    parts = _step_parts(r)
    if parts["collectives"] == NOT_APART:
      parts["collectives"] = "too short to take apart from the arithmetic"
    else:
      parts["collectives"] = f"{parts['collectives']:.0f} ms"
    text.append(
        fill(
            "cluster_reading",
            **parts,
            link=plots.link_label(r["bandwidth"]),
            added=100 * (parts["step"] / parts["compute"] - 1),
        )
    )
  return " ".join(text)


def _within(mine, key: str) -> str:
  """How many of the model's predictions ``key`` meet its target."""
  errors = targets.model_errors(mine, key)
  return fill(
      "cluster_within",
      hits=targets.within_model_error(errors),
      steps=len(errors),
      goal=thresholds.MODEL_ERROR,
      largest=max(errors, default=0),
  )


def _workload(model: dict[str, Any]) -> str:
  size, base = model["size"], models.BERT_SIZES["base"]
  text = fill("cluster_workload", **model)
  if all(size[k] == base[k] for k in ("hidden", "heads", "ffn")):
    text += " " + fill(
        "cluster_workload_base",
        layers=size["num_layers"],
        base_layers=base["num_layers"],
        slow_link=plots.link_label(thresholds.SLOW_LINK),
    )
  return text


def _on_cores(rows, groups) -> str:
  """Where the workers ran: the machine's cores, and workers per core."""
  cores = _cores(rows)
  if cores is None:
    return ""
  per_core = "; ".join(
      f"{w}{' workers' if i == 0 else ''}: {w / cores:g} per core"
      for i, w in enumerate(groups)
  )
  return " " + fill("cluster_cores", cores=cores, per_core=per_core)


def _per_workers(groups) -> list[str]:
  """Each worker count's records and ACP-SGD's speedups on each link."""
  blocks = []
  for workers, group in groups.items():
    speedups = [
        {
            "bandwidth": b,
            **{
                label: targets.ratio(
                    group, ("acp_jax", "acp_sgd"), (system, name), b
                )
                for label, system, name, _ in thresholds.CLUSTER_SPEEDUPS
            },
            "PyTorch DDP": targets.ratio(
                group, ("acp_jax", "acp_sgd"), ("torch", "ssgd"), b
            ),
        }
        for b in dict.fromkeys(r["bandwidth"] for r in group)
    ]
    blocks.append(
        fill(
            "cluster_workers",
            workers=workers,
            table=records.table(group, cluster.COLUMNS),
            speedups=records.table(speedups, _SPEEDUP_COLUMNS),
        )
    )
  return blocks


def _links(calibration) -> list[dict[str, Any]]:
  """The psum microbenchmark's fit per worker count and link, in us and
  MB/s."""
  rows = {}
  for r in calibration:
    rows[r["workers"], r["bandwidth"]] = {
        "workers": r["workers"],
        "bandwidth": r["bandwidth"],
        "alpha_us": r["alpha_s"] * 1e6,
        "mb_per_s": 1 / r["beta_s_per_byte"] / 1e6,
        "busy_alpha_us": r["busy_alpha_s"] * 1e6,
        "busy_mb_per_s": 1 / r["busy_beta_s_per_byte"] / 1e6,
    }
  return list(rows.values())


def cluster_section(rows, calibration, out: pathlib.Path) -> list[str]:
  plots.cluster(rows, out / "cluster.png")
  mine = [r for r in rows if r["system"] == "acp_jax"]
  groups = targets.by_workers(rows)
  head = fill(
      "cluster",
      provenance=template.provenance(rows),
      workers=template.and_list(map(str, groups)),
      on_cores=_on_cores(rows, groups),
      workload=_workload(workloads.CLUSTER_MODELS[rows[0]["model"]]),
      psum_from=_binary_size(min(cluster.PSUM_SIZES)),
      psum_to=_binary_size(max(cluster.PSUM_SIZES)),
      repeats=max(r.get("repeats", 1) for r in rows),
      steps=max(r.get("timed_steps", 0) for r in mine),
      warmup=max(r.get("warmup_steps", 0) for r in mine),
      dense_steps=cluster.DENSE_SLOW_STEPS,
      dense_min=plots.link_label(f"{cluster.DENSE_MIN_MBIT}mbit"),
      ratio_table=records.table(
          _compute_to_link(mine, calibration), _RATIO_COLUMNS
      ),
      within_idle=_within(mine, "predicted_step_s"),
      within_busy=_within(mine, "predicted_busy_step_s"),
  )
  tail = fill(
      "cluster_parts",
      busy_mb=cluster.BUSY_MB,
      parts_table=records.table(
          [_step_parts(r) for r in _taken_apart(mine)], _STEP_PARTS_COLUMNS
      ),
      not_apart=NOT_APART,
      reading=_cluster_reading(_taken_apart(mine)),
      links_table=records.table(_links(calibration), _LINKS_COLUMNS),
  )
  return [head, *_per_workers(groups), tail]


def _projection_inputs(projected) -> list[dict[str, Any]]:
  """Each model's measured inputs to the projection, a row per model."""
  inputs = {}
  for r in projected:
    inputs.setdefault(
        r["model"],
        {
            "model": r["model"],
            "batch_per_worker": r["batch_per_worker"],
            "forward_backward_s": r["forward_backward_s"],
        },
    )[f"update_ms_{r['compressor']}"] = r["update_s"] * 1e3
  return list(inputs.values())


def projection_section(rows, out: pathlib.Path) -> list[str]:
  projected = [r for r in rows if r["kind"] == "projection"]
  if not projected:
    return []
  plots.projection(projected, out / "projection.png")
  gbits = [
      re.fullmatch(r"(\d+)gbit", b)[1]
      for b in dict.fromkeys(r["bandwidth"] for r in projected)
  ]
  scales = sorted({r["compute_scale"] for r in projected} - {1})
  columns = {
      "model": "model",
      "batch_per_worker": "batch/worker",
      "forward_backward_s": "fwd+bwd, s",
      **{
          f"update_ms_{c}": f"{plots.LABELS[c]} update, ms"
          for c in workloads.COMPRESSORS
      },
  }
  return [
      fill(
          "projection",
          provenance=template.provenance(projected),
          links=template.and_list(gbits) + " Gb/s",
          alpha_us=projected[0]["alpha_s"] * 1e6,
          backward_share=fractions.Fraction(
              costmodel.BACKWARD_SHARE
          ).limit_denominator(100),
          scales=template.and_list(map(str, scales)),
          scale_columns=", ".join(
              f"*compute x{s}*" if i == 0 else f"*x{s}*"
              for i, s in enumerate(scales)
          ),
          inputs_table=records.table(_projection_inputs(projected), columns),
          averages_table=records.table(
              project.averages(projected), _AVERAGES_COLUMNS
          ),
      )
  ]


def _sharded_reading(rows) -> str:
  """The sharded mode's paragraph, with its examples/s over the
  hierarchical mode's on each link; empty if it did not run."""
  bandwidths = dict.fromkeys(
      r["bandwidth"] for r in rows if r["mode"] == "sharded"
  )
  ratios = {b: targets.sharded_ratio(rows, b) for b in bandwidths}
  if not ratios:
    return ""
  return fill(
      "hierarchical_sharded",
      ratios=template.and_list(
          f"on {plots.link_label(b)}, {r}"
          for b, r in ratios.items()
          if r is not None
      )
      or "not measured",
  )


def hierarchical_section(rows) -> list[str]:
  first = rows[0]
  shown = [
      {**r, "method": f"{plots.LABELS[r['compressor']]}, {r['mode']}"}
      for r in rows
  ]
  return [
      fill(
          "hierarchical",
          **first,
          provenance=template.provenance(rows),
          table=records.table(shown, _HIERARCHICAL_COLUMNS),
      ),
      _sharded_reading(rows),
  ]


def _method_label(system: str, name: str, rank: int) -> str:
  """A cluster method as the README names it: ``ACP-SGD (r=4)``,
  ``PyTorch DDP + `powerSGD_hook` (r=4)``."""
  label = plots.LABELS[name]
  if registry.get(name).low_rank:
    label += f" (r={rank})"
  if system == "torch":
    label = "PyTorch DDP" + (
        f" + `powerSGD_hook` (r={rank})" if name == "power_sgd" else ""
    )
  return label


def summary_table(rows) -> str:
  """The README's table of one cluster run: each method's examples/s per
  link and worker count (the median of its runs), with its bytes per step
  per worker; in bold, the method of a column that was the fastest in
  every round, where one was."""
  rank = workloads.CLUSTER_MODELS[rows[0]["model"]]["rank"]
  where = lambda r: (r["bandwidth"], r["workers"])
  columns = list(dict.fromkeys(map(where, rows)))
  fastest = {c: _fastest_every_round(rows, *c) for c in columns}
  head = ["method", "bytes/step per worker"] + [
      f"{plots.link_label(b)}, {w} workers" for b, w in columns
  ]
  lines = [head, ["---"] + ["---:"] * (len(head) - 1)]
  methods = dict.fromkeys((r["system"], r["compressor"]) for r in rows)
  for method in methods:
    mine = {
        where(r): r for r in rows if (r["system"], r["compressor"]) == method
    }
    sent = next(iter(mine.values())).get("bytes_per_step")
    line = [_method_label(*method, rank), f"{sent:,.0f}" if sent else ""]
    for c in columns:
      speed = mine[c]["examples_per_sec"] if c in mine else None
      text = "" if speed is None else f"{speed:.3g}"
      line.append(f"**{text}**" if method == fastest[c] else text)
    lines.append(line)
  return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _fastest_every_round(rows, bandwidth, workers) -> tuple[str, str] | None:
  """The (system, compressor) faster than every other method on a link in
  each round, or None where no method was."""
  group = [r for r in rows if r["workers"] == workers]
  here = [
      (r["system"], r["compressor"])
      for r in group
      if r["bandwidth"] == bandwidth
  ]
  for method in here:
    if all(
        targets.ratio(group, method, other, bandwidth).clears(1)
        for other in here
        if other != method
    ):
      return method
  return None


_ADVICE_COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "advised": "advised",
    "advised_examples_per_sec": "its examples/s",
    "best": "measured best",
    "best_examples_per_sec": "its examples/s",
    "ratio": "advised / best",
    "best_eligible": "best within the threshold",
    "eligible_ratio": "advised / it",
}


def measured_errors(advice) -> str:
  """The errors the ``advice`` records measured, per model and workers;
  each once, though records at several links measured it again."""
  measured = {}
  for r in advice:
    if r["error_to_noise"]:
      text = f"{r['name']} {r['error_to_noise']:.3f} (cosine {r['cosine']:.3f})"
      measured.setdefault((r["model"], r["workers"]), {})[text] = None
  return "; ".join(
      f"{model} on {workers} workers: " + ", ".join(names)
      for (model, workers), names in measured.items()
  )


def advice_section(rows, calibration, advice) -> list[str]:
  """At each measured point of the shaped-link sweep
  (``advice_check.points``), the advice against the measured best, from
  the ``advice`` records of the sweep's models."""
  advice = [r for r in advice if r["model"] not in convergence.TASKS]
  if not advice:
    return []
  table, missing = advice_check.points(rows, calibration, advice)
  calibration_line = advice_lib.Calibration.recorded().describe()
  return [
      fill(
          "advice",
          provenance=template.provenance(advice),
          errors=measured_errors(advice),
          calibration=calibration_line,
          table=records.table(table, _ADVICE_COLUMNS) if table else "",
          missing=(
              "No advice record for " + template.and_list(missing) + "."
              if missing
              else ""
          ),
      )
  ]


_OVERLAP_COLUMNS = {
    "workers": "workers",
    "link": "link",
    "method": "method",
    "fused": "fused ms",
    "overlapped": "overlapped ms",
    "compute": "compute-only ms",
    "collectives": "collectives, priced ms",
    "limit": "overlap limit ms",
    "over_limit": "overlapped vs limit",
    "speedup": "fused / overlapped",
}


def _priced_collectives(r, cluster_rows) -> float | None:
  """Seconds of ``r``'s collectives as the cost model prices them: the
  cluster run's prediction less its compute-only step, for the same model,
  workers, link and compressor (None where the cluster did not run it)."""
  for c in cluster_rows:
    same = all(
        c.get(k) == r[k] for k in ("model", "workers", "bandwidth", "compressor")
    )
    if same and c.get("system") == "acp_jax" and "predicted_step_s" in c:
      return c["predicted_step_s"] - c["step_local_s"]
  return None


def _spread(r, key: str, scale: float = 1e3) -> str:
  return (
      f"{scale * r[key]:.0f} ({scale * r[key + '_min']:.0f}–"
      f"{scale * r[key + '_max']:.0f})"
  )


def overlap_rows(rows, cluster_rows) -> list[dict[str, Any]]:
  """Each overlap record as the report's table shows it, with its limit:
  the larger of its compute-only step and its priced collectives."""
  out = []
  for r in rows:
    priced = _priced_collectives(r, cluster_rows)
    limit = None if priced is None else max(r["local_s"], priced)
    out.append({
        "workers": r["workers"],
        "link": plots.link_label(r["bandwidth"]),
        "method": plots.LABELS[r["compressor"]],
        "fused": _spread(r, "fused_s"),
        "overlapped": _spread(r, "overlapped_s"),
        "compute": _spread(r, "local_s"),
        "collectives": "not priced" if priced is None else f"{1e3 * priced:.0f}",
        "limit": "" if limit is None else f"{1e3 * limit:.0f}",
        "over_limit": (
            ""
            if limit is None
            else f"{100 * (r['overlapped_s'] / limit - 1):+.0f}%"
        ),
        "speedup": (
            f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–"
            f"{r['speedup_max']:.2f})"
        ),
    })
  return out


def _acp_over_power(run) -> str:
  """ACP-SGD's overlapped step against Power-SGD's, per link and workers
  of one run that ran both, each round paired with the same round."""
  lines = []
  for acp in (r for r in run if r["compressor"] == "acp_sgd"):
    power = [
        r
        for r in run
        if r["compressor"] == "power_sgd"
        and (r["workers"], r["bandwidth"]) == (acp["workers"], acp["bandwidth"])
    ]
    if not power:
      continue
    ratios = [
        p / a
        for a, p in zip(
            records.runs(acp, "overlapped_s"),
            records.runs(power[0], "overlapped_s"),
        )
    ]
    lines.append(
        f"- {acp['workers']} workers, {plots.link_label(acp['bandwidth'])}:"
        f" Power-SGD / ACP-SGD overlapped {statistics.median(ratios):.2f}×"
        f" (rounds {', '.join(f'{x:.2f}' for x in ratios)})"
    )
  return "\n".join(lines)


def overlap_step_section(rows, cluster_rows) -> list[str]:
  """The overlapped step against the fused one: a table per run."""
  blocks = [
      fill(
          "overlap_step",
          steps=max(r["timed_steps"] for r in rows),
          rounds=max(len(records.runs(r, "speedup")) for r in rows),
      )
  ]
  for run in records.by_run(rows):
    blocks.append(
        fill(
            "overlap_step_run",
            provenance=template.provenance(run),
            table=records.table(overlap_rows(run, cluster_rows), _OVERLAP_COLUMNS),
            acp_over_power=_acp_over_power(run),
        )
    )
  return blocks


_QUALITY_ADVICE_COLUMNS = {
    "task": "task",
    "workers": "workers",
    "bandwidth": "link",
    "warmup": "dense steps",
    "fastest": "fastest",
    "fastest_s": "its seconds",
    "short_runs": "short runs",
    "advised": "advised",
    "advised_s": "its seconds",
    "ratio": "advised / fastest",
    "ratio_max": "worst round",
}


def quality_advice_section(rows, curves, links, advice) -> list[str]:
  """At each point of the time-to-quality runs
  (``advice_check.quality_points``), the advice against the fastest method,
  from the ``advice`` records of the runs' tasks: a section per machine."""
  advice = [r for r in advice if r["model"] in convergence.TASKS]
  table = advice_check.quality_points(rows, curves, links, advice)
  out = []
  for machine in dict.fromkeys(r["machine"] for r in table):
    here = [r for r in table if r["machine"] == machine]
    dates = {r["date"] for r in here}
    mine = [r for r in advice if r["machine"] == machine]
    out.append(
        fill(
            "advice_quality",
            machine=consistency.machine({"machine": machine}),
            provenance=template.provenance(
                mine + [r for r in rows if r["date"] in dates]
            ),
            errors=measured_errors(mine),
            table=records.table(here, _QUALITY_ADVICE_COLUMNS),
            goal=thresholds.ADVICE_TIME_TO_QUALITY,
        )
    )
  return out


