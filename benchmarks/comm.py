"""Bytes and collectives per step, from the accounting and from compiled HLO.

For each model and compressor the update is lowered on abstract shapes (no
parameter is allocated, so BERT-Large costs no memory) under ``shard_map``
over the simulated devices, compiled with XLA:CPU's all-reduce combiner off,
and its collectives read back from the compiled text. They must equal what
``acp_jax.comm_bytes`` says, phase by phase.

For the overlap with backprop, the whole train step of ``train/train.py``
(forward, backward, compressor, optimizer, metrics) is compiled the same
way, on abstract state and batch, in every phase, once with the
compressor's default buckets and once with all leaves in one bucket; and
``acp_jax_tools.hlo.overlap_potential`` reads from each how much of the step's
compute its collectives could run beside.
"""

import math
import time
from typing import Any

import jax

import acp_jax
from acp_jax_tools import hlo
from benchmarks import cli
from benchmarks import records as records_lib
from benchmarks import thresholds
from benchmarks import workloads
from train import experiment as experiment_lib
from train import train

# Without it XLA:CPU merges every independent all-reduce into one, which
# hides how many a method issues.
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def compiled_phases(
    tx: acp_jax.Compressor, params: Any, mesh: jax.sharding.Mesh
) -> list[dict[str, int]]:
  """Collectives of ``tx.update`` in each phase, read from compiled HLO.

  Returns one dict per phase (ACP-SGD: P, then Q) with the bytes, the
  all-reduce and all-gather op counts, and the dependent rounds.
  """
  dp = acp_jax.DataParallel(tx, mesh)
  compress = jax.jit(dp.compress)
  grads = dp.abstract_local_grads(params)
  phases = []
  for state in dp.phase_states(dp.abstract_comm(params)).values():
    text = (
        compress.lower(grads, state)
        .compile(compiler_options=NO_COMBINER)
        .as_text()
    )
    traffic = hlo.traffic(text)
    phases.append(
        {
            "bytes": sum(s.bytes for s in traffic.values()),
            "all_reduce_ops": traffic["all-reduce"].count,
            "all_gather_ops": traffic["all-gather"].count,
            "other_ops": sum(
                s.count
                for k, s in traffic.items()
                if k not in ("all-reduce", "all-gather")
            ),
            "rounds": hlo.collective_rounds(text),
        }
    )
  return phases


def measure(models: list[str]) -> list[dict[str, Any]]:
  """One record per model and compressor."""
  records = []
  for model in models:
    exp = workloads.experiment(model)
    params, mesh = exp.abstract_params, exp.mesh
    about = workloads.describe(model)
    rows = {}
    for name in workloads.COMPRESSORS:
      tx = workloads.compressor(model, name)
      volumes = [
          v.total
          for v in acp_jax.comm_bytes(
              tx, params, num_devices=mesh.size
          ).values()
      ]
      compiled = compiled_phases(tx, params, mesh)
      row = {
          **about,
          "compressor": name,
          "num_devices": mesh.size,
          "bytes_per_step": sum(volumes) / len(volumes),
          "hlo_bytes_per_step": (
              sum(h["bytes"] for h in compiled) / len(compiled)
          ),
          "hlo_matches_accounting": [h["bytes"] for h in compiled] == volumes,
          "all_reduce_ops": max(h["all_reduce_ops"] for h in compiled),
          "all_gather_ops": max(h["all_gather_ops"] for h in compiled),
          "other_collective_ops": max(h["other_ops"] for h in compiled),
          "rounds": max(h["rounds"] for h in compiled),
      }
      if len(volumes) == 2:  # ACP-SGD's P-steps and Q-steps
        row.update(
            bytes_p=volumes[0],
            bytes_q=volumes[1],
            hlo_bytes_p=compiled[0]["bytes"],
            hlo_bytes_q=compiled[1]["bytes"],
        )
      rows[name] = row
    for row in rows.values():
      row["ratio_vs_ssgd"] = (
          rows["ssgd"]["bytes_per_step"] / row["bytes_per_step"]
      )
    acp, power = rows["acp_sgd"], rows["power_sgd"]
    acp["target_bytes"] = (
        thresholds.ACP_BYTES_VS_POWER_SGD * power["bytes_per_step"]
        + about["dense_bytes"]
    )
    acp["meets_target"] = acp["bytes_per_step"] <= acp["target_bytes"]
    acp["vs_power_sgd"] = acp["bytes_per_step"] / power["bytes_per_step"]
    records.extend(rows.values())
  return records


# The paper's models whose whole train step ``overlap`` compiles.
OVERLAP_MODELS = ("resnet50", "bert_base")
# Bucket layouts: the default, and every leaf in one packed bucket.
LAYOUTS = {"before": math.inf, "after": None}


def step_overlap(
    model: str, compressor: str, bucket_bytes: float | None
) -> tuple[acp_jax.Compressor, dict[str, hlo.OverlapReport]]:
  """The compressor of ``model``'s train step with ``bucket_bytes`` (None:
  its default) and, for each phase, the overlap report of that step,
  compiled with XLA:CPU's all-reduce combiner off."""
  cfg = workloads.config(model, compressor)
  if bucket_bytes is not None:
    cfg.compressor[compressor].bucket_bytes = bucket_bytes
  experiment = experiment_lib.build(cfg)
  train_fn, _ = train.compile_steps(experiment)
  batch = experiment_lib.abstract_batch(experiment)
  reports = {}
  for phase, state in experiment_lib.abstract_phase_states(experiment).items():
    text = (
        train_fn.lower(state, batch)
        .compile(compiler_options=NO_COMBINER)
        .as_text()
    )
    reports[phase] = hlo.overlap_potential(text)
  return experiment.compressor, reports


def overlap(models: list[str]) -> list[dict[str, Any]]:
  """One record per model, compressor and phase: the buckets, the step's
  collectives and their bytes-weighted independent and upstream shares,
  ``before`` (one bucket) and ``after`` (the default buckets)."""
  records = []
  for model in models:
    params = workloads.experiment(model).abstract_params
    for name in workloads.COMPRESSORS:
      start = time.perf_counter()
      rows = {}
      for layout, bucket_bytes in LAYOUTS.items():
        tx, reports = step_overlap(model, name, bucket_bytes)
        for phase, report in reports.items():
          rows.setdefault(
              phase,
              {
                  "model": model,
                  "compressor": name,
                  "phase": phase,
                  "num_devices": jax.device_count(),
              },
          ).update({
              f"buckets_{layout}": len(tx.buckets(params)),
              f"collectives_{layout}": len(report.collectives),
              f"bytes_{layout}": sum(c.bytes for c in report.collectives),
              f"independent_{layout}": report.bytes_weighted_potential,
              f"upstream_{layout}": (
                  report.bytes_weighted_upstream_potential
              ),
          })
      seconds = time.perf_counter() - start
      for row in rows.values():
        row["compile_s"] = seconds / len(rows)
      records.extend(rows.values())
  return records


OVERLAP_COLUMNS = {
    "model": "model",
    "compressor": "compressor",
    "phase": "phase",
    "buckets_before": "buckets before",
    "buckets_after": "after",
    "collectives_before": "collectives before",
    "collectives_after": "after",
    "independent_before": "independent before",
    "independent_after": "after",
    "upstream_before": "upstream before",
    "upstream_after": "after",
}


COLUMNS = {
    "model": "model",
    "params": "params",
    "compressed_matrices": "matrices",
    "compressor": "compressor",
    "bytes_per_step": "bytes/step",
    "bytes_p": "P-step",
    "bytes_q": "Q-step",
    "hlo_bytes_per_step": "HLO bytes/step",
    "hlo_matches_accounting": "HLO = accounting",
    "ratio_vs_ssgd": "x fewer than S-SGD",
    "all_reduce_ops": "all-reduces",
    "all_gather_ops": "all-gathers",
    "rounds": "rounds",
}


HELP = "bytes and collectives per step"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  cli.add_models(parser)
  parser.add_argument(
      "--overlap_models",
      type=cli.WORKLOADS,
      help="comma-separated workloads whose whole train step is compiled for"
      " its overlap with backprop, '' for none (default: resnet50,bert_base;"
      " small_cnn with --quick)",
  )


def main(args) -> None:
  meta = cli.start(args, args.num_cpu_devices)
  rows = measure(cli.default_models(args))
  outputs = {"comm": rows}
  models = args.overlap_models
  if models is None:
    models = ["small_cnn"] if args.quick else list(OVERLAP_MODELS)
  if models:
    start = time.perf_counter()
    outputs["overlap"] = overlap(models)
    print(records_lib.table(outputs["overlap"], OVERLAP_COLUMNS))
    print(f"overlap: compiled in {time.perf_counter() - start:.0f} s")
  cli.finish(args, meta, outputs, rows, COLUMNS)
