"""The compute each compressor adds: wall time of its update on a model's
gradient shapes.

The update runs under ``shard_map`` over a one-device mesh, so its
collectives move nothing and the time is the compressor's own arithmetic
(residuals, projections, orthogonalization, selection, packing). Each update
is jitted, warmed up, then timed ``repeats`` times; the median is reported.
The gradients are random normal, drawn by NumPy.

A plain ``lax.psum`` of each leaf (``psum_per_leaf``) is timed beside them:
what S-SGD's exchange costs without any bucketing.

Where PyTorch is installed, its ``powerSGD_hook`` (``benchmarks/torch_hook.py``)
runs on the same shapes at the same rank, in the same turns: the
implementation a user would otherwise pick. The thread settings of both
sides are recorded with each row. acp_jax runs on XLA:CPU's thread pool (one
thread per core) with its LAPACK calls on one thread
(``acp_jax.limit_lapack_threads``, set by ``python -m benchmarks``). PyTorch
runs twice: with as many threads as XLA:CPU uses, and on one thread (which its
LAPACK calls, MKL's, share with its products: no setting limits them alone),
and our ratios are taken against the faster.
"""

import importlib.util
import os
import statistics
from typing import Any

import jax
from jax import lax
import numpy as np
from threadpoolctl import threadpool_info

from acp_jax_tools import timing
from benchmarks import cli
from benchmarks import thresholds
from benchmarks import workloads


# The mean of each leaf by its own psum, on one device: S-SGD's floor.
PSUM = "psum_per_leaf"


def psum_call(params: Any, seed: int = 0):
  """A zero-argument call: ``lax.psum(g) / n`` of each leaf of random
  gradients shaped like ``params``, under ``shard_map`` on one device."""
  mesh = jax.make_mesh(
      (1,),
      ("data",),
      devices=jax.devices()[:1],
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  spec = jax.sharding.PartitionSpec("data")
  rng = np.random.default_rng(seed)
  grads = jax.tree.map(
      lambda x: jax.device_put(
          rng.standard_normal((1,) + tuple(x.shape), np.float32).astype(
              x.dtype
          ),
          jax.sharding.NamedSharding(mesh, spec),
      ),
      params,
  )

  def mean(grads):
    n = lax.axis_size("data")
    return jax.tree.map(lambda g: lax.psum(g[0], "data") / n, grads)

  step = jax.jit(
      jax.shard_map(
          mean,
          mesh=mesh,
          in_specs=spec,
          out_specs=jax.sharding.PartitionSpec(),
          check_vma=False,
      )
  )
  return lambda: step(grads)


# PyTorch's Power-SGD hook, beside acp_jax's compressors: on as many threads
# as XLA:CPU uses, and on one.
TORCH = "torch_power_sgd"
TORCH_ONE_THREAD = "torch_power_sgd_1_thread"


def _torch_call(model: str, params: Any, threads: int):
  """One step of PyTorch's ``powerSGD_hook`` on ``params``' shapes, with
  the rank and minimum compression rate of the model's Power-SGD."""
  from benchmarks import torch_hook

  args = workloads.config(model).compressor.power_sgd
  return torch_hook.PowerSGDStep(
      params, args.rank, args.min_compression_rate, threads=threads
  )


def jax_threads() -> str:
  """acp_jax's thread settings, as they are now."""
  lapack = sorted({
      i["num_threads"]
      for i in threadpool_info()
      if i["user_api"] == "blas" and "scipy" in i["filepath"]
  })
  return (
      f"XLA:CPU {os.cpu_count()} threads; LAPACK (SciPy's OpenBLAS)"
      f" {','.join(map(str, lapack)) or 'not loaded'}"
  )


def torch_threads(threads: int) -> str:
  return f"torch.set_num_threads({threads}): ops, MKL BLAS and LAPACK"


def measure(models: list[str], repeats: int) -> list[dict[str, Any]]:
  """One record per model and compressor (and PyTorch's Power-SGD, where
  torch is installed)."""
  with_torch = importlib.util.find_spec("torch") is not None
  torch_threads_by_name = (
      {TORCH: os.cpu_count(), TORCH_ONE_THREAD: 1} if with_torch else {}
  )
  names = workloads.COMPRESSORS + (PSUM,) + tuple(torch_threads_by_name)
  records = []
  for model in models:
    params = workloads.experiment(model).abstract_params
    about = workloads.describe(model)
    calls = _calls(model, params, torch_threads_by_name)
    ours = jax_threads()  # after the calls are made: the LAPACK is loaded
    times = timing.interleaved(calls, repeats)
    del calls  # frees the gradients and states before the next model
    rows = {}
    for name in names:
      threads = (
          torch_threads(torch_threads_by_name[name])
          if name in torch_threads_by_name
          else ours
      )
      phases = [t for (n, _), t in times.items() if n == name]
      rows[name] = {
          "model": model,
          "params": about["params"],
          "compressor": name,
          "repeats": repeats,
          **_times(phases, threads),
      }
    _compare(model, rows, tuple(torch_threads_by_name))
    records.extend(rows.values())
  return records


def _calls(model: str, params, torch_threads_by_name: dict[str, int]):
  """The updates to time on ``model``'s ``params``, by (name, phase): each
  compressor's phases, the psum per leaf and PyTorch's hook at each thread
  setting."""
  calls = {
      (name, phase): call
      for name in workloads.COMPRESSORS
      for phase, call in enumerate(
          timing.phase_calls(workloads.compressor(model, name), params)
      )
  }
  calls[PSUM, 0] = psum_call(params)
  for name, threads in torch_threads_by_name.items():
    calls[name, 0] = _torch_call(model, params, threads)
  return calls


def _times(phases: list[list[float]], threads: str) -> dict[str, Any]:
  """A row's times in ms from each phase's timed calls (in s), the mean over
  phases of the medians and of the minima, its ``threads``, and with two
  phases (ACP-SGD's P-steps and Q-steps) each phase's median."""
  medians = [statistics.median(t) * 1e3 for t in phases]
  out = {
      "update_ms": statistics.fmean(medians),
      "min_ms": statistics.fmean(min(t) * 1e3 for t in phases),
      "threads": threads,
  }
  if len(medians) == 2:
    out.update(update_ms_p=medians[0], update_ms_q=medians[1])
  return out


def _compare(model: str, rows: dict[str, dict], torch_names: tuple[str, ...]):
  """Adds to ``rows`` (one model's, by name) the ratios and the targets:
  against S-SGD, ACP-SGD against Power-SGD, S-SGD against the psum, and,
  with ``torch_names``, both low-rank methods against PyTorch's hook at its
  faster thread setting."""
  base = rows["ssgd"]["update_ms"]
  for row in rows.values():
    row["added_ms"] = row["update_ms"] - base
    row["vs_ssgd"] = row["update_ms"] / base
  acp, power = rows["acp_sgd"], rows["power_sgd"]
  acp["vs_power_sgd"] = acp["update_ms"] / power["update_ms"]
  acp["meets_target"] = acp["vs_power_sgd"] <= thresholds.ACP_VS_POWER_SGD
  rows["ssgd"]["vs_psum"] = base / rows[PSUM]["update_ms"]
  if torch_names:
    # Against the implementation a user would otherwise pick, at its
    # faster thread setting.
    fastest = min(torch_names, key=lambda n: rows[n]["update_ms"])
    torch_ms = rows[fastest]["update_ms"]
    for name, row in (("acp_sgd", acp), ("power_sgd", power)):
      row["vs_torch"] = row["update_ms"] / torch_ms
      row["torch_reference"] = fastest
      goal = thresholds.VS_TORCH[name].get(model)
      if goal is not None:
        row["meets_torch_target"] = row["vs_torch"] <= goal


COLUMNS = {
    "model": "model",
    "compressor": "compressor",
    "update_ms": "update ms (median)",
    "update_ms_p": "P-step ms",
    "update_ms_q": "Q-step ms",
    "added_ms": "added over S-SGD, ms",
    "vs_ssgd": "x S-SGD",
    "vs_power_sgd": "ACP / Power",
    "vs_torch": "x PyTorch Power-SGD",
    "vs_psum": "x psum per leaf",
    "threads": "threads",
}


HELP = "compute each compressor adds"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  cli.add_models(parser)
  parser.add_argument(
      "--repeats", type=cli.int_at_least(1), help="timed calls per update"
  )


def main(args) -> None:
  meta = cli.start(args, args.num_cpu_devices)
  repeats = args.repeats or (3 if args.quick else 10)
  # BERT-Large's five compressor states and top-k's sort space outgrow
  # 24 GB; ask for it with --models where there is more memory.
  models = cli.default_models(args, skip=("bert_large",))
  rows = measure(models, repeats)
  cli.finish(args, meta, {"overhead": rows}, rows, COLUMNS)
