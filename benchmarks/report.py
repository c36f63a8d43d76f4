"""``results/REPORT.md``: the measurements' tables and figures, with the
targets of ``targets.py`` checked against them.

The prose is ``report_template.md``'s; this module fills its fields from the
JSON files beside the report (and from the constants of the code that the
prose names), draws the plots and renders the tables. Each section says the
machine, date and command that made its numbers.
"""

import importlib
import os
import pathlib
import re
from typing import Any

from acp_jax import buckets
from benchmarks import comm
from benchmarks import consistency
from benchmarks import convergence
from benchmarks import convergence_summary
from benchmarks import direction as bench_direction
from benchmarks import overhead
from benchmarks import pipeline
from benchmarks import plots
from benchmarks import records
from benchmarks import report_cluster
from benchmarks import report_quality
from benchmarks import targets
from benchmarks import thresholds
from benchmarks import template
from benchmarks import workloads
from benchmarks.template import fill

# Each model's table has a heading that gives these.
_PER_MODEL_COLUMNS = {
    k: v
    for k, v in comm.COLUMNS.items()
    if k not in ("model", "params", "compressed_matrices")
}
# The record files the report reads, in the order of its sections.
RECORD_FILES = (
    "comm",
    "overlap",
    "overhead",
    "convergence",
    "convergence_curves",
    "convergence_direction",
    "cluster",
    "cluster_links",
    "quality",
    "quality_curves",
    "overlap_step",
    "advice",
    "projection",
    "cluster_hierarchical",
    "pipeline",
)
# The subcommand that writes a record file, where it is not the file's name.
_COMMANDS = {
    "advice": "advise --model bert_base_2l --workers 2,4 --bandwidth inf"
    " --ranks 4 --measure_all --json",
    "projection": "project",
    "cluster_hierarchical": "cluster --hierarchical",
}
_BUCKET_MIB = buckets.DEFAULT_BUCKET_BYTES / 2**20


def _comm_section(rows, out: pathlib.Path) -> list[str]:
  plots.bars(
      rows,
      "bytes_per_step",
      "bytes per step per device",
      "Bytes each device sends per step (ACP-SGD: mean of P and Q)",
      out / "comm_bytes.png",
  )
  blocks = [
      fill(
          "comm",
          provenance=template.provenance(rows),
          bucket_mib=_BUCKET_MIB,
      )
  ]
  for model in plots.model_names(rows):
    model_rows = [r for r in rows if r["model"] == model]
    blocks.append(
        fill(
            "comm_model",
            **model_rows[0],
            table=records.table(model_rows, _PER_MODEL_COLUMNS),
        )
    )
  goal = thresholds.ACP_BYTES_VS_POWER_SGD
  acp = [r for r in rows if r["compressor"] == "acp_sgd"]
  columns = {
      "model": "model",
      "bytes_per_step": "ACP-SGD bytes/step",
      "target_bytes": f"{goal} x Power + dense",
      "vs_power_sgd": "ACP / Power",
      "meets_target": "met",
  }
  blocks.append(
      fill("comm_target", goal=goal, table=records.table(acp, columns))
  )
  return blocks + _overlap_section(out)


def _overlap_section(out: pathlib.Path) -> list[str]:
  """The structure of each paper model's train step: how much backprop its
  collectives could hide behind, in one bucket and in the default buckets."""
  rows = records.read("overlap", out)
  if not rows:
    return [fill("overlap_not_run")]
  percent = lambda x: f"{x:.1%}"
  shown = [
      {
          **r,
          "compressor": plots.LABELS[r["compressor"]],
          "phase": r["phase"].upper() if r["phase"] != "step" else "",
          **{
              f"{share}_{layout}": percent(r[f"{share}_{layout}"])
              for share in ("independent", "upstream")
              for layout in comm.LAYOUTS
          },
      }
      for r in rows
  ]
  return [
      fill(
          "overlap",
          provenance=template.provenance(rows),
          devices=", ".join(map(str, sorted({r["num_devices"] for r in rows}))),
          bucket_mib=_BUCKET_MIB,
          seconds=sum(r["compile_s"] for r in rows),
          table=records.table(shown, comm.OVERLAP_COLUMNS),
      )
  ]


def _overhead_section(rows, out: pathlib.Path) -> list[str]:
  plots.bars(
      rows,
      "update_ms",
      "update time, ms (median)",
      "Compressor update on one device (no communication)",
      out / "overhead.png",
  )
  return [
      fill(
          "overhead",
          provenance=template.provenance(rows),
          table=records.table(rows, overhead.COLUMNS),
      )
  ]


def _stalls(curves, warmup: int) -> list[dict[str, Any]]:
  """The char LM's train loss around the switch out of the warm-up, a row
  per variant that ran, a column per step after the switch."""
  return [
      {
          "variant": variant,
          **{
              f"K + {step - warmup}": loss
              for step, loss in convergence_summary.stall(
                  curves, variant, warmup
              ).items()
          },
      }
      for variant in ("acp_sgd_warm", "acp_sgd_warm_cold", "acp_sgd")
      if any(c["variant"] == variant for c in curves)
  ]


def _gap_table(curves, task: str = "char_lm") -> str:
  variants = tuple(
      v
      for v in (
          "power_sgd",
          "acp_sgd",
          "acp_sgd_2r",
          "power_sgd_warm",
          "acp_sgd_warm",
          "acp_sgd_2r_warm",
          "power_sgd_2r_bf16_warm",
          "acp_sgd_4r_bf16_warm",
      )
      if any(c["variant"] == v and c["task"] == task for c in curves)
  )
  rows = convergence_summary.gaps(curves, task, variants)
  if not rows:
    return ""
  columns = {k: k for row in rows for k in row}
  return records.table(rows, columns)


# The direction measurements' columns (``benchmarks.direction``).
_DIRECTION_COLUMNS = {
    "variant": "variant",
    "grad": "cosine: mean sent vs its true mean",
    "adam": "cosine: Adam update vs S-SGD's",
    "adam_shared": "the same, from S-SGD's moments",
    "steps": "steps measured",
}
# And those that only the closed experiments' rows hold.
_CLOSED_DIRECTION_COLUMNS = {
    **_DIRECTION_COLUMNS,
    "bytes_vs_rank": "bytes vs the rank's (accordion)",
    "high_fraction": "steps at 2x the rank (accordion)",
}


def _direction(rows) -> str:
  """Why a low-rank method's AdamW run falls behind: how far its averaged
  quantity and its update turn from S-SGD's, on real gradients."""
  if not rows:
    return ""
  return fill(
      "convergence_direction",
      provenance=template.provenance(rows),
      warmup=rows[0]["warmup_steps"],
      table=records.table(rows, _DIRECTION_COLUMNS),
  )


def _closed(summary, finals, direction) -> str:
  """The closed experiments' records (of the variants that the benchmarks
  no longer run): their convergence runs ``summary``, the screen beside Adam
  after the same compressor, and their ``direction`` measurements."""
  closed = [
      r for r in direction if not bench_direction.is_measured(r["variant"])
  ]
  if not summary and not closed:
    return ""
  runs = [r for r in finals if r["variant"] not in convergence.VARIANTS]
  return fill(
      "convergence_closed",
      provenance=template.provenance(runs + closed),
      table=(
          records.table(summary, convergence_summary.CLOSED_COLUMNS)
          if summary
          else ""
      ),
      screen=_screen(finals, direction),
      direction=(
          records.table(closed, _CLOSED_DIRECTION_COLUMNS) if closed else ""
      ),
  )


# Each screened variant of the convergence runs (Adam in the compressed
# subspace, DeMo's decoupled momentum): the variant with Adam after the same
# compressor, rank and warm-up, and the two variants' direction benchmark
# names.
_SCREEN_PAIRS = {
    "acp_sgd_2r_subspace_warm": (
        "acp_sgd_2r_warm",
        "acp_sgd_r8_subspace_adam",
        "acp_sgd_r8",
    ),
    "acp_sgd_2r_subspace_track_warm": (
        "acp_sgd_2r_warm",
        "acp_sgd_r8_subspace_adam_track",
        "acp_sgd_r8",
    ),
    "acp_sgd_2r_subspace_rms_warm": (
        "acp_sgd_2r_warm",
        "acp_sgd_r8_subspace_adam_rms",
        "acp_sgd_r8",
    ),
    "acp_sgd_2r_subspace_track_rms_warm": (
        "acp_sgd_2r_warm",
        "acp_sgd_r8_subspace_adam_track_rms",
        "acp_sgd_r8",
    ),
    "acp_sgd_2r_subspace": ("acp_sgd_2r", None, None),
    "power_sgd_subspace_warm": (
        "power_sgd_warm",
        "power_sgd_r4_subspace_adam",
        "power_sgd_r4",
    ),
    "acp_sgd_2r_decoupled_warm": (
        "acp_sgd_2r_warm",
        "acp_sgd_r8_decoupled",
        "acp_sgd_r8",
    ),
    "power_sgd_decoupled_warm": (
        "power_sgd_warm",
        "power_sgd_r4_decoupled",
        "power_sgd_r4",
    ),
}


def _screen(finals, direction) -> str:
  """The screened variants' runs beside the runs of Adam after the same
  compressor (same task, seed, rank and warm-up), with the direction
  benchmark's cosine of each update with S-SGD's (over the longest window
  measured for both)."""
  loss = {(r["task"], r["variant"], r["seed"]): r for r in finals}
  cosine = {}
  for r in sorted(direction, key=lambda r: r["steps"]):
    cosine.setdefault(r["variant"], {})[r["steps"]] = r["adam"]
  rows = []
  for (task, variant, seed), r in sorted(loss.items()):
    if variant not in _SCREEN_PAIRS:
      continue
    plain, name, base = _SCREEN_PAIRS[variant]
    other = loss.get((task, plain, seed))
    ssgd = loss.get((task, "ssgd", seed))
    if other is None or ssgd is None:
      continue
    steps = set(cosine.get(name, ())) & set(cosine.get(base, ()))
    rows.append(
        {
            "task": task,
            "seed": seed,
            "variant": variant,
            "held-out loss": round(r["eval_loss"], 4),
            "Adam after it": f"{plain} {other['eval_loss']:.4f}",
            "S-SGD": round(ssgd["eval_loss"], 4),
            "update cosine vs S-SGD's": (
                f"{cosine[name][n]:.3f} (Adam after it"
                f" {cosine[base][n]:.3f}; {n} steps)"
                if (n := max(steps, default=None))
                else ""
            ),
        }
    )
  if not rows:
    return ""
  return records.table(rows, {k: k for k in rows[0]})


def _convergence_section(
    finals, curves, direction, out: pathlib.Path
) -> list[str]:
  rows = convergence_summary.summarize(finals, curves)
  # The closed experiments' runs are kept apart, in a section of their own.
  closed = [r for r in rows if r["variant"] not in convergence.VARIANTS]
  rows = [r for r in rows if r["variant"] in convergence.VARIANTS]
  measured = [
      r for r in direction if bench_direction.is_measured(r["variant"])
  ]
  # The plot and the tables below read the seeds the summary reads.
  _, curves, left_out = convergence_summary.without_untrained(finals, curves)
  curves = [c for c in curves if c["variant"] in convergence.VARIANTS]
  plots.convergence(curves, out / "convergence.png")
  warmup = max(r["warmup_steps"] for r in finals)
  stalls = _stalls(curves, warmup)
  later = sorted(
      {int(k[len("K + ") :]) for row in stalls for k in row if k[0] == "K"}
      - {0}
  )
  char_lm = dict(convergence.TASKS["char_lm"][1])
  config = importlib.import_module(
      f"configs.{convergence.TASKS['char_lm'][0]}"
  ).get_config()
  bert = workloads.load_config(*convergence.TASKS["bert_mlm"])
  bert_config = importlib.import_module(
      f"configs.{convergence.TASKS['bert_mlm'][0]}"
  ).get_config()
  return [
      fill(
          "convergence",
          provenance=template.provenance(finals),
          num_devices=finals[0]["num_devices"],
          batch=char_lm["batch_size"],
          seq_len=char_lm["data.seq_len"],
          config_batch=config.batch_size,
          config_seq_len=config.data.seq_len,
          steps=finals[0]["steps"],
          warmup=warmup,
          left_out=fill(
              "convergence_left_out",
              seeds=template.and_list(
                  f"`{task}` seed {seed}" for task, seed in sorted(left_out)
              )
              or "none",
              plateau_pct=100 * convergence_summary.PLATEAU_FRACTION,
          ),
          table=records.table(rows, convergence_summary.COLUMNS),
          later=template.and_list(map(str, later)),
          stall_table=(
              records.table(stalls, {k: k for k in stalls[0]}) if stalls else ""
          ),
          gap_table=_gap_table(curves),
          long_gap_table=_gap_table(curves, "char_lm_long"),
          long_steps=convergence.LONG_STEPS,
          bert_batch=bert.batch_size,
          bert_seq_len=bert.data.seq_len,
          bert_config_batch=bert_config.batch_size,
          bert_config_seq_len=bert_config.data.seq_len,
          bert_rank=bert.compressor.power_sgd.rank,
          bert_lr_warmup=bert.schedule.warmup_steps,
          bert_gap_table=_gap_table(curves, "bert_mlm"),
          sgd_lr=dict(convergence.SGD)["optimizer.learning_rate"],
          reading=_convergence_reading(rows, curves, warmup),
          direction=_direction(measured),
          closed=_closed(closed, finals, direction),
          minutes=sum(r["wall_seconds"] for r in finals) / 60,
          runs=len(finals),
      )
  ]


def _convergence_reading(rows, curves, warmup: int) -> str:
  """What the char LM's runs say about the warm-up, in their own numbers."""
  by = {r["variant"]: r for r in rows if r["task"] == "char_lm"}
  needed = (
      "acp_sgd_2r_warm",
      "power_sgd_warm",
      "acp_sgd_2r",
      "power_sgd",
      "acp_sgd_warm",
      "acp_sgd_warm_cold",
  )
  warm = convergence_summary.stall(curves, "acp_sgd_warm", warmup)
  cold = convergence_summary.stall(curves, "acp_sgd_warm_cold", warmup)
  after = sorted(set(warm) & set(cold))[1:2]
  if not all(v in by for v in needed) or not after:
    return ""
  gap = lambda v: by[v]["loss_vs_ssgd_pct"]
  return fill(
      "convergence_reading",
      acp_2r_warm=gap("acp_sgd_2r_warm"),
      acp_2r=gap("acp_sgd_2r"),
      power_warm=gap("power_sgd_warm"),
      power=gap("power_sgd"),
      after=after[0] - warmup,
      train_change=warm[after[0]] - cold[after[0]],
      eval_change=(
          by["acp_sgd_warm"]["eval_loss"] - by["acp_sgd_warm_cold"]["eval_loss"]
      ),
  )


def _pipeline_section(rows) -> list[str]:
  workers = [r["workers"] for r in rows if r["kind"] == "pipeline"]
  return [
      fill(
          "pipeline",
          global_batch=rows[0]["global_batch"],
          image_size=rows[0]["image_size"],
          workers=f"{min(workers)}-{max(workers)}",
          provenance=template.provenance(rows),
          table=records.table(rows, pipeline.COLUMNS),
      )
  ]


def _sections(found, out: pathlib.Path) -> list[str]:
  """Each section whose records are present, and for each of the others a
  line saying what to run."""
  sections = {
      "comm": lambda rows: _comm_section(rows, out),
      "overhead": lambda rows: _overhead_section(rows, out),
      "convergence": lambda rows: _convergence_section(
          rows, found["convergence_curves"], found["convergence_direction"], out
      ),
      "cluster": lambda rows: report_cluster.cluster_section(
          rows, found["cluster_links"], out
      ),
      "quality": lambda rows: report_quality.quality_section(
          rows, found["quality_curves"], out
      ),
      "overlap_step": lambda rows: report_cluster.overlap_step_section(
          rows, found["cluster"]
      ),
      "advice": lambda rows: report_cluster.advice_section(
          found["cluster"], found["cluster_links"], rows
      )
      + report_cluster.quality_advice_section(
          found["quality"],
          found["quality_curves"],
          found["cluster_links"],
          rows,
      ),
      "projection": lambda rows: report_cluster.projection_section(rows, out),
      "cluster_hierarchical": report_cluster.hierarchical_section,
      "pipeline": _pipeline_section,
  }
  blocks = []
  for name, section in sections.items():
    if found[name]:
      blocks += section(found[name])
    else:
      blocks.append(fill("not_run", command=_COMMANDS.get(name, name)))
  return blocks


def write(results_dir: os.PathLike) -> str:
  """Writes ``REPORT.md`` and its plots into ``results_dir``; returns a line
  saying where."""
  out = pathlib.Path(results_dir)
  found = {name: records.read(name, out) for name in RECORD_FILES}
  if not any(found[k] for k in ("comm", "overhead", "convergence", "cluster")):
    raise SystemExit(
        f"no results in {out}: run python -m benchmarks comm, overhead and"
        " convergence first"
    )
  broken = consistency.check(found)
  if broken:
    raise SystemExit(
        f"the records in {out} do not make one report:\n- "
        + "\n- ".join(broken)
    )
  blocks = [fill("head")]
  ran_on = consistency.machines(found)
  if len(ran_on) > 1:
    blocks.append(
        fill(
            "machines",
            machines="\n".join(
                f"- {m}: {', '.join(names)}" for m, names in ran_on.items()
            ),
        )
    )
  if any(r.get("quick") for rows in found.values() for r in rows):
    blocks.append(fill("quick"))
  checked = [
      {"target": t, "measured": m, "met": ok}
      for t, m, ok in targets.check(found)
  ]
  columns = {"target": "target", "measured": "measured", "met": "met"}
  blocks.append(fill("targets", table=records.table(checked, columns)))
  blocks += _sections(found, out)
  text = "\n\n".join(b for b in blocks if b) + "\n"
  path = out / "REPORT.md"
  # A field left empty leaves no run of blank lines.
  path.write_text(re.sub(r"\n{3,}", "\n\n", text))
  return f"wrote {path}"


HELP = "REPORT.md with tables and plots"


def add_arguments(parser) -> None:
  del parser  # the report reads --results_dir only


def main(args) -> None:
  print(write(args.results_dir))
  rows = records.read("cluster", args.results_dir)
  if rows:
    print("The README's table of the cluster run:")
    print(report_cluster.summary_table(rows))
  rows = report_quality.with_startup(
      records.read("quality", args.results_dir),
      records.read("quality_curves", args.results_dir),
  )
  if rows:
    print("The README's headline, the runs of seeded rounds:")
    print(report_quality.overview_table(rows))
  for run in records.by_run(rows):
    print(
        f"The README's table of time to quality, {run[0]['task']}, the run"
        f" of {run[0]['date']}:"
    )
    print(report_quality.summary_table(run))
