"""The cost model projected to the paper's clusters: ResNet-50/152 and
BERT-Base/Large on 8 to 64 workers with 1, 10 and 100 Gb/s links.

Per model, measured here on one CPU device: the train step's time at two
per-device batches (S-SGD, whose one-device all-reduce moves nothing),
which splits it into a per-example part (forward and backward) and a fixed
part (the optimizer), and each compressor's update time (from a full
``overhead`` run in the results folder where it has the model). The bytes come
from the accounting (``acp_jax.comm_bytes``) at each cluster size, each
method's all-reduces fused into its rounds (tensor fusion, as XLA's
combiner and DDP's buckets do). The link latency is the one calibrated on
this machine's links (``cluster_links.json``), the bandwidth the link's
rate. Communication overlaps backprop for the pipelined methods, as in the
paper's and PyTorch DDP's runtimes.

This CPU computes far slower than the paper's GPUs, so the projection is
also given with all compute ``scale`` times faster: a sensitivity, not a
measurement of any accelerator. Where a ``gpu`` run measured the model
(``gpu.json``: float32 forward+backward at the paper's per-GPU batch and
every compressor's update on one GPU), its times are used instead, once,
unscaled; the base optimizer's step, not timed there, counts as nothing.
"""

import statistics
import time
from typing import Any

import jax
import numpy as np

import acp_jax
from acp_jax_tools import costmodel
from acp_jax_tools import timing
from benchmarks import cli
from benchmarks import launch
from benchmarks import records as records_lib
from benchmarks import workloads
from train import experiment as experiment_lib
from train import train

SIZES = (8, 16, 32, 64)
RATES = {"1gbit": 1_000.0, "10gbit": 10_000.0, "100gbit": 100_000.0}
SCALES = (1, 10, 100)
# The paper's averages over its models, cluster sizes and links.
PAPER = {"acp_vs_ssgd": 4.06, "acp_vs_power_sgd": 1.43}


def _train_step_seconds(model: str, batch: int, repeats: int) -> float:
  """Median time of S-SGD's train step at per-device ``batch``."""
  cfg = workloads.config(model, "ssgd")
  cfg.batch_size, cfg.per_device_batch_size = 0, batch
  experiment = experiment_lib.build(cfg)
  train_fn, _ = train.compile_steps(experiment)
  state = experiment_lib.init_state(experiment)
  data = experiment_lib.put_batch(
      experiment, experiment.dataset.train.get(np.arange(batch))
  )
  times = []
  for i in range(repeats + 2):  # two warm-up calls: compiling, allocating
    start = time.perf_counter()
    state, _ = train_fn(state, data)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  return statistics.median(times[2:])


def forward_backward(model: str, batches: tuple[int, int], repeats: int):
  """Seconds per example of forward+backward, and the step's fixed seconds
  (the optimizer), from S-SGD's train step at two batches on one device."""
  small, large = batches
  t_small = _train_step_seconds(model, small, repeats)
  t_large = _train_step_seconds(model, large, repeats)
  per_example = max(t_large - t_small, 0.0) / (large - small)
  return per_example, max(t_small - small * per_example, 0.0)


def update_seconds(model: str, repeats: int) -> dict[str, float]:
  """Each compressor's update on one device, as ``overhead`` times it."""
  params = workloads.experiment(model).abstract_params
  out = {}
  for name in workloads.COMPRESSORS:  # one state alive at a time
    calls = timing.phase_calls(workloads.compressor(model, name), params)
    times = timing.interleaved(dict(enumerate(calls)), repeats)
    out[name] = statistics.fmean(statistics.median(t) for t in times.values())
    del calls
  return out


def traffic(model: str, compressor: str, p: int) -> list[costmodel.Traffic]:
  """Each phase's bytes on ``p`` workers, fused into the method's rounds."""
  tx = workloads.compressor(model, compressor)
  params = workloads.experiment(model).abstract_params
  return costmodel.traffic(
      acp_jax.comm_bytes(tx, params, num_devices=p), compressor
  )


def project(
    model: str,
    batch: int,
    per_example: float,
    fixed: float,
    updates: dict[str, float],
    alpha: float,
    scales: tuple[int, ...] = SCALES,
) -> list[dict[str, Any]]:
  """Predicted examples/s of each compressor on every cluster, and ACP-SGD's
  speedups, with compute ``scales`` times faster than measured."""
  rows = []
  for p in SIZES:
    phases = {c: traffic(model, c, p) for c in workloads.COMPRESSORS}
    for rate_name, rate in RATES.items():
      link = costmodel.Link.ideal(rate, alpha)
      for scale in scales:
        forward_backward = per_example * batch / scale
        backward = costmodel.BACKWARD_SHARE * forward_backward
        speed = {}
        for c, ts in phases.items():
          step = forward_backward + (fixed + updates[c]) / scale
          seconds = statistics.fmean(
              costmodel.step_seconds(
                  step, backward, t, c, p, link, overlap=True
              )
              for t in ts
          )
          speed[c] = batch * p / seconds
        for c, value in speed.items():
          rows.append(
              {
                  "model": model,
                  "workers": p,
                  "bandwidth": rate_name,
                  "compute_scale": scale,
                  "compressor": c,
                  "predicted_examples_per_sec": value,
                  "acp_speedup": speed["acp_sgd"] / value,
              }
          )
  return rows


def gpu_times(
    gpu_rows: list[dict[str, Any]], model: str
) -> tuple[float, dict[str, float]] | None:
  """Seconds per example of forward+backward and each compressor's update
  seconds of ``model`` in float32, from a ``gpu`` run's records; None unless
  it measured them all."""
  ok = [
      r
      for r in gpu_rows
      if r["model"] == model and r.get("dtype") == "float32"
      and r["status"] == "ok"
  ]
  forward_backward = [r for r in ok if r["kind"] == "forward_backward"]
  updates = {r["compressor"]: r["seconds"] for r in ok if r["kind"] == "update"}
  if not forward_backward or set(updates) < set(workloads.COMPRESSORS):
    return None
  (fb,) = forward_backward
  return fb["seconds"] / fb["batch_per_device"], updates


def measure(
    models: list[str],
    alpha: float,
    batches: tuple[int, int],
    repeats: int,
    overhead_rows: list[dict[str, Any]] = (),
    gpu_rows: list[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
  """Projected records of ``models``. Compute times come from ``gpu_rows``
  (a ``gpu`` run) where they have the model, and are measured on this CPU
  otherwise; then update times come from ``overhead_rows`` (a full
  ``overhead`` run) where they have the model, and are measured here
  otherwise."""
  known = {
      (r["model"], r["compressor"]): r["update_ms"] / 1e3
      for r in overhead_rows
      if not r["quick"]
  }
  records = []
  for model in models:
    cfg = workloads.config(model)
    batch = cfg.per_device_batch_size or cfg.batch_size // 8
    on_gpu = gpu_times(gpu_rows, model)
    if on_gpu:
      (per_example, updates), fixed = on_gpu, 0.0
      compute, source, scales = "gpu", "gpu.json", (1,)
    else:
      per_example, fixed = forward_backward(model, batches, repeats)
      compute, scales = "cpu", SCALES
      if all((model, c) in known for c in workloads.COMPRESSORS):
        updates = {c: known[model, c] for c in workloads.COMPRESSORS}
        source = "overhead.json"
      else:
        updates, source = update_seconds(model, repeats), "measured"
    print(
        f"{model}: forward+backward {per_example * batch:.3g} s at"
        f" {batch}/device (on {compute}), fixed"
        f" {fixed * 1e3:.0f} ms, updates ({source}) "
        + ", ".join(f"{c} {u * 1e3:.3g} ms" for c, u in updates.items()),
        flush=True,
    )
    rows = project(model, batch, per_example, fixed, updates, alpha, scales)
    for row in rows:
      row.update(
          kind="projection",
          compute_source=compute,
          batch_per_worker=batch,
          forward_backward_s=per_example * batch,
          fixed_s=fixed,
          update_s=updates[row["compressor"]],
          update_source=source,
          alpha_s=alpha,
      )
      records.append(row)
  return records


def averages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """ACP-SGD's mean speedups over S-SGD and Power-SGD per compute source
  ("cpu", "gpu") and scale, over every model, cluster size and link, beside
  the paper's."""
  key = lambda r: (r.get("compute_source", "cpu"), r["compute_scale"])
  out = []
  for source, scale in sorted({key(r) for r in rows}):
    mine = [r for r in rows if key(r) == (source, scale)]
    row = {"compute_source": source, "compute_scale": scale}
    for c in ("ssgd", "power_sgd"):
      row[f"acp_vs_{c}"] = statistics.fmean(
          r["acp_speedup"] for r in mine if r["compressor"] == c
      )
      row[f"paper_acp_vs_{c}"] = PAPER[f"acp_vs_{c}"]
    out.append(row)
  return out


def validation(cluster_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The cluster runs' measured and predicted examples/s side by side."""
  return [
      {
          "kind": "cluster",
          "model": r["model"],
          "workers": r["workers"],
          "bandwidth": r["bandwidth"],
          "compressor": r["compressor"],
          "measured_examples_per_sec": r["examples_per_sec"],
          "predicted_examples_per_sec": r["predicted_examples_per_sec"],
          "error": r["predicted_examples_per_sec"] / r["examples_per_sec"] - 1,
      }
      for r in cluster_runs
      if r["system"] == "acp_jax"
  ]


# For the printed summary: averages, then the cluster checks.
COLUMNS = {
    "compute_source": "compute on",
    "compute_scale": "compute x",
    "acp_vs_ssgd": "ACP / S-SGD",
    "paper_acp_vs_ssgd": "paper",
    "acp_vs_power_sgd": "ACP / Power-SGD",
    "paper_acp_vs_power_sgd": "paper",
    "bandwidth": "link",
    "compressor": "compressor",
    "measured_examples_per_sec": "measured examples/s",
    "predicted_examples_per_sec": "predicted",
    "error": "error",
}


HELP = "the cost model at 8-64 workers and 1-100 Gb/s"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  cli.add_models(parser)
  parser.add_argument(
      "--alpha_us",
      type=float,
      help="link latency (default: calibrated by cluster, unshaped link)",
  )


def _alpha(args) -> float:
  """``--alpha_us`` in seconds, or the latency calibrated on the fastest
  link of the cluster run (unshaped where it ran): a message's cost on the
  namespaces' veth links and bridge, whatever their rate."""
  if args.alpha_us is not None:
    if args.alpha_us < 0:
      raise SystemExit(f"--alpha_us must be >= 0, got {args.alpha_us}")
    return args.alpha_us * 1e-6
  links = records_lib.read("cluster_links", args.results_dir)
  if not links:
    raise SystemExit(
        "project: no link calibration in"
        f" {args.results_dir}/cluster_links.json; run `python -m"
        " benchmarks cluster` first or pass --alpha_us"
    )
  rate = lambda r: launch.BANDWIDTHS[r["bandwidth"]] or float("inf")
  return max(links, key=rate)["alpha_s"]


def main(args) -> None:
  meta = cli.start(args, 1)  # timed on one device, the clusters modelled
  alpha = _alpha(args)
  read = lambda name: records_lib.read(name, args.results_dir)
  projected = measure(
      args.models or list(workloads.PAPER),
      alpha,
      (2, 4),
      2 if args.quick else 5,
      read("overhead"),
      read("gpu"),
  ) + validation(read("cluster"))
  # Hundreds of projected rows: the averages and the checks print.
  rows = averages([r for r in projected if r["kind"] == "projection"]) + [
      r for r in projected if r["kind"] == "cluster"
  ]
  cli.finish(args, meta, {"projection": projected}, rows, COLUMNS)
