"""A real cluster on one machine: N worker processes, each in its own network
namespace on a switched link of 1 Gb/s, 10 Gb/s or unshaped
(``benchmarks/links.py``), training with ``jax.distributed`` over gloo, and
PyTorch DDP (plain and with its PowerSGD hook) on the very same links.

Per worker count and bandwidth, a psum microbenchmark calibrates the cost
model's alpha and beta twice: on idle workers, and right after a pass over
memory, as a step's collectives follow its compute (``calibrate``). Each
compressor then runs the workload's data-parallel step (``worker parts``):
the fused step's median, its parts (forward and backward, the compressor
with and without its collectives, the optimizer, the host's dispatch) and
the same fused step on each worker's device alone, all workers in lockstep:
the compute-only step. The model predicts the step as the compute-only step
plus the step's compiled collectives on the idle link
(``predicted_step_s``); ``predicted_busy_step_s`` prices them on the busy
link instead, the hypothesis that a collective on busy cores pays a
scheduling latency per hop, which the measured steps do not bear out.

Compute-only is measured in lockstep because free-running lone processes
are not the cluster's compute when there are more workers than cores: they
contend for the cores in a way the lockstepped cluster workers do not.

``measure_hierarchical`` makes each process a node of several devices and
compares hierarchical compression (a dense mean within the node, the
compressor across nodes), the same with the model sharded within the node
(``acp_jax.ShardedDataParallel``), and flat compression over all devices.
"""

import importlib.util
import os
import signal
import statistics
import sys
import tempfile
from typing import Any

from benchmarks import cli
from benchmarks import cluster_nodes
from benchmarks import costmodel
from benchmarks import launch
from benchmarks import links
from benchmarks import workloads

BANDWIDTHS = launch.BANDWIDTHS
TORCH = ("ssgd", "power_sgd")
# Their train step takes minutes to compile at 4 workers (Sign-SGD 212 s in
# one process here; four processes compile at once on 2 cores), so by
# default they run on the fastest link only, where the paper finds them
# losing to S-SGD.
FASTEST_LINK_ONLY = ("sign_sgd", "topk_sgd")
PSUM_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
# The pass over memory before each busy all-reduce of the calibration: about
# as long as a part of the cluster workload's step.
BUSY_MB = 40


def _torch_args(model: str, compressor: str, steps: int) -> list[str]:
  m = workloads.CLUSTER_MODELS[model]
  size = m["size"]
  return [
      "-m",
      "benchmarks.torch_peer",
      f"--compressor={compressor}",
      f"--rank={m['rank']}",
      f"--steps={steps}",
      f"--layers={size['num_layers']}",
      f"--hidden={size['hidden']}",
      f"--heads={size['heads']}",
      f"--ffn={size['ffn']}",
      f"--vocab_size={m['vocab_size']}",
      f"--seq_len={m['seq_len']}",
      f"--batch_size={m['batch_size']}",
  ]


def calibrate(
    network: links.Network, timeout: float
) -> tuple[costmodel.Link, costmodel.Link, list[dict[str, Any]]]:
  """Fits alpha and beta to all-reduce times on ``network``, on idle
  workers and on busy ones; returns both links and a record per size of
  ``PSUM_SIZES``: the slowest worker's seconds, idle and busy, and the
  fitted links.

  *Busy* is the all-reduce's share of a program that first makes a pass
  over ``BUSY_MB`` of memory, every worker at once, as a train step's
  collectives follow its compute. On oversubscribed cores a ring's every
  hop then waits for its receiver to be scheduled: the latency the idle
  calibration does not see.
  """
  sizes = ",".join(str(s) for s in PSUM_SIZES)
  results = launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "psum",
          f"--sizes={sizes}",
          f"--busy_mb={BUSY_MB}",
          *launch.distributed(network, i),
      ),
      timeout,
  )
  p = len(network.names)
  fitted, rows = [], [{"size_bytes": s} for s in PSUM_SIZES]
  for key in ("psum_seconds", "busy_psum_seconds"):
    seconds = [max(r[key][str(s)] for r in results) for s in PSUM_SIZES]
    link = costmodel.fit_all_reduce(PSUM_SIZES, seconds, p)
    fitted.append(link)
    prefix = "busy_" if key.startswith("busy") else ""
    for row, t in zip(rows, seconds):
      row.update(
          {
              f"{prefix}psum_seconds": t,
              f"{prefix}alpha_s": link.alpha,
              f"{prefix}beta_s_per_byte": link.beta,
          }
      )
  return fitted[0], fitted[1], rows


def predict(step_local: float, phases, workers: int, link) -> float:
  """The model's step: the compute-only step plus each phase's
  communication on ``link``, averaged over the phases. XLA:CPU runs a
  step's thunks in order, so nothing is hidden behind backprop."""
  return statistics.mean(
      step_local + costmodel.Traffic(**t).seconds(workers, link) for t in phases
  )


def _jax_run(network, model, name, steps, timeout, idle, busy):
  """One compressor's ``parts`` run on ``network``, as a record."""
  results = launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "parts",
          f"--workload={model}",
          f"--compressor={name}",
          f"--steps={steps}",
          *launch.distributed(network, i),
      ),
      timeout,
  )
  workers = len(network.names)
  batch = workloads.CLUSTER_MODELS[model]["batch_size"] * workers
  # A synchronous step waits for its slowest worker.
  seconds = {
      k: max(r["seconds"][k] for r in results) for k in results[0]["seconds"]
  }
  phases = results[0]["traffic"]
  step, local = seconds["step"], seconds["step_local"]
  predicted = predict(local, phases, workers, idle)
  return {
      "system": "acp_jax",
      "compressor": name,
      "examples_per_sec": batch / step,
      "compute_only_examples_per_sec": batch / local,
      "predicted_examples_per_sec": batch / predicted,
      "step_s": step,
      "predicted_step_s": predicted,
      "predicted_busy_step_s": predict(local, phases, workers, busy),
      "error_pct": 100 * (predicted - step) / step,
      **{f"{k}_s": v for k, v in seconds.items() if k != "step"},
      "bytes_per_step": statistics.mean(
          t["all_reduce"] + t["all_gather"] / workers for t in phases
      ),
      "params_identical": len({r["params_sha256"] for r in results}) == 1,
  }


def _torch_run(network, model, name, steps, timeout):
  workers = len(network.names)
  results = launch.on_network(
      network,
      lambda i: [sys.executable]
      + _torch_args(model, name, steps)
      + [
          f"--master_addr={network.address(0)}",
          "--master_port=29500",
          f"--world_size={workers}",
          f"--process_id={i}",
          # As torchrun: one thread per process when the cores are shared
          # (torch's spinning threads oversubscribe).
          f"--threads={max(1, os.cpu_count() // workers)}",
      ],
      timeout,
  )
  return {
      "system": "torch",
      "compressor": name,
      "examples_per_sec": results[0]["examples_per_sec"],
      "params_identical": len({r["params_sha256"] for r in results}) == 1,
  }


def measure(
    model: str,
    workers: list[int],
    bandwidths: list[str],
    steps: int,
    timeout: float,
    with_torch: bool,
    compressors=workloads.COMPRESSORS,
    fastest_link_only=FASTEST_LINK_ONLY,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
  """Cluster records (one per worker count, bandwidth, system and
  compressor), link calibration records (one per worker count, bandwidth
  and psum size) and the runs that failed, each with its reason. The
  ``fastest_link_only`` compressors run on the last bandwidth only.

  The workers share one persistent compilation cache, made here and
  removed after: each program compiles once per worker count, not once
  per link.
  """
  runs, calibration, failures = [], [], []
  with tempfile.TemporaryDirectory() as cache, launch.compilation_cache(cache):
    for p in workers:
      for bandwidth in bandwidths:
        with links.switched(p, BANDWIDTHS[bandwidth]) as network:
          idle, busy, rows = calibrate(network, timeout)
          print(
              f"{p} workers, {bandwidth}: alpha {idle.alpha * 1e6:.0f} us"
              f" idle, {busy.alpha * 1e6:.0f} us busy; beta"
              f" {1 / idle.beta / 1e6:.0f} MB/s idle,"
              f" {1 / busy.beta / 1e6:.0f} MB/s busy",
              flush=True,
          )
          base = {"bandwidth": bandwidth, "workers": p, "model": model}
          calibration.extend({**base, **row} for row in rows)
          last = bandwidth == bandwidths[-1]
          for name in compressors:
            if name in fastest_link_only and not last:
              continue
            run = launch.attempt(
                failures,
                f"{p} workers {bandwidth} acp_jax {name}",
                lambda: _jax_run(
                    network, model, name, steps, timeout, idle, busy
                ),
            )
            if run is not None:
              runs.append({**base, **run})
              _show(runs[-1])
          for name in TORCH if with_torch else ():
            run = launch.attempt(
                failures,
                f"{p} workers {bandwidth} torch {name}",
                lambda: _torch_run(network, model, name, steps, timeout),
            )
            if run is not None:
              runs.append({**base, **run})
              _show(runs[-1])
  return runs, calibration, failures


def _show(run: dict[str, Any]) -> None:
  predicted = run.get("predicted_examples_per_sec")
  extra = f" (model: {predicted:.2f})" if predicted else ""
  print(
      f"  {run['system']} {run['compressor']}:"
      f" {run['examples_per_sec']:.2f} examples/s{extra}",
      flush=True,
  )


COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "system": "system",
    "compressor": "compressor",
    "examples_per_sec": "examples/s",
    "predicted_examples_per_sec": "model",
    "compute_only_examples_per_sec": "compute only",
    "error_pct": "model error, %",
    "params_identical": "same params",
}

HELP = "worker processes on shaped network links (needs root)"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--workers",
      type=cli.ints_at_least(2),
      help="comma-separated worker counts (default: 2,4; with"
      " --hierarchical, one count, default 2)",
  )
  parser.add_argument(
      "--model",
      default="bert_base_2l",
      choices=tuple(workloads.CLUSTER_MODELS),
      help="a cluster model of benchmarks/workloads.py",
  )
  parser.add_argument(
      "--bandwidths",
      type=cli.names(tuple(BANDWIDTHS), "bandwidth"),
      default="1gbit,10gbit,unshaped",
      help="comma-separated, of 1gbit, 10gbit, unshaped",
  )
  parser.add_argument(
      "--steps", type=cli.int_at_least(4), help="train steps per run"
  )
  parser.add_argument(
      "--compressors",
      type=cli.names(workloads.COMPRESSORS, "compressor"),
      help="comma-separated (default: all five)",
  )
  parser.add_argument(
      "--timeout", type=float, default=900, help="seconds per run"
  )
  parser.add_argument(
      "--no_torch", action="store_true", help="skip the PyTorch peer"
  )
  parser.add_argument(
      "--hierarchical",
      action="store_true",
      help="each worker a node of --devices_per_worker devices: hierarchical"
      " ACP-SGD, and the same with the model sharded within a node, against"
      " flat ACP-SGD and S-SGD",
  )
  parser.add_argument(
      "--devices_per_worker", type=cli.int_at_least(1), default=2
  )


def main(args) -> None:
  reason = links.unavailable()
  if reason:
    print(f"cluster: skipped, {reason}")
    return
  meta = cli.start(args, 1)  # each worker is a process of its own devices
  workers = args.workers or ([2] if args.hierarchical else [2, 4])
  if args.hierarchical and len(workers) != 1:
    raise SystemExit(
        f"--workers: --hierarchical takes one count, got {args.workers}"
    )
  steps = args.steps or (6 if args.quick else 10)
  # A SIGTERM unwinds like an error, so the links come down.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if args.hierarchical:
    runs, failures = cluster_nodes.measure_hierarchical(
        args.model,
        workers[0],
        args.devices_per_worker,
        args.bandwidths,
        steps,
        args.timeout,
    )
    outputs = {"cluster_hierarchical": runs}
    cli.finish(args, meta, outputs, runs, cluster_nodes.COLUMNS, failures)
    return
  torch = not args.no_torch and importlib.util.find_spec("torch") is not None
  if not torch and not args.no_torch:
    print("cluster: torch is not installed, the PyTorch peer is skipped")
  runs, calibration, failures = measure(
      args.model,
      workers,
      args.bandwidths,
      steps,
      args.timeout,
      torch,
      args.compressors or workloads.COMPRESSORS,
      # Asked for by name, they run on every link.
      () if args.compressors else FASTEST_LINK_ONLY,
  )
  outputs = {"cluster": runs, "cluster_links": calibration}
  cli.finish(args, meta, outputs, runs, COLUMNS, failures)
