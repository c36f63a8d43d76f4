"""A real cluster on one machine: N worker processes, each in its own network
namespace on a switched link of 1 Gb/s, 10 Gb/s or unshaped
(``benchmarks/links.py``), training with ``jax.distributed`` over gloo, and
PyTorch DDP (plain and with its PowerSGD hook) on the very same links.

Per bandwidth, a psum microbenchmark calibrates the cost model's alpha and
beta; each compressor then trains the cluster workload for a few steps and
reports its steady-state examples/s (the median step). Before any link is
built, every compressor also runs compute-only: N lone processes at once,
one device each, so the collectives move nothing but the cores are shared as
in the cluster run. Those times and the calibrated links predict each
cluster figure (``predicted_examples_per_sec`` beside the measured one).

``measure_hierarchical`` makes each process a node of several devices and
compares hierarchical compression (a dense mean within the node, the
compressor across nodes) with flat compression over all devices.
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import costmodel
from benchmarks import links
from benchmarks import workloads

BANDWIDTHS = {"1gbit": 1000.0, "10gbit": 10000.0, "unshaped": None}
TORCH = ("ssgd", "power_sgd")
# Their train step takes minutes to compile at 4 workers (Sign-SGD 212 s in
# one process here; four processes compile at once on 2 cores), so by
# default they run on the fastest link only, where the paper finds them
# losing to S-SGD.
FASTEST_LINK_ONLY = ("sign_sgd", "topk_sgd")
PSUM_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
_COORDINATOR_PORT = 8476


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


def _launch(commands: list[list[str]], timeout: float) -> list[dict[str, Any]]:
  """Runs the commands at once and returns each one's ``RESULT`` record;
  all are killed if one fails or ``timeout`` seconds pass."""
  env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
  with contextlib.ExitStack() as stack:
    # Files, not pipes: a chatty worker cannot block on a full pipe.
    logs = [
        [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe"]
        for _ in commands
    ]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
        for cmd, (out, err) in zip(commands, logs)
    ]
    deadline = time.monotonic() + timeout
    try:
      for proc in procs:
        try:
          proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
          raise TimeoutError(
              f"{' '.join(proc.args)} ran past {timeout:.0f} s"
          ) from None
    finally:
      for proc in procs:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
    outputs = []
    for proc, (out, err) in zip(procs, logs):
      out.seek(0)
      err.seek(0)
      if proc.returncode:
        raise RuntimeError(
            f"{' '.join(proc.args)} exited with {proc.returncode}:\n"
            + "\n".join(err.read().strip().splitlines()[-15:])
        )
      lines = [l for l in out.read().splitlines() if l.startswith("RESULT ")]
      if not lines:
        raise RuntimeError(f"{' '.join(proc.args)} printed no RESULT line")
      outputs.append(json.loads(lines[-1][len("RESULT ") :]))
    return outputs


def _jax_cmd(mode: str, *args: str) -> list[str]:
  return [sys.executable, "-m", "benchmarks.worker", mode, *args]


def _distributed(network: links.Network, worker: int) -> list[str]:
  return [
      f"--coordinator_address={network.address(0)}:{_COORDINATOR_PORT}",
      f"--num_processes={len(network.names)}",
      f"--process_id={worker}",
  ]


def _on_network(network, make_cmd, timeout):
  return _launch(
      [network.exec_prefix(i) + make_cmd(i) for i in range(len(network.names))],
      timeout,
  )


def _attempt(failures: list[str], what: str, run):
  """``run()``'s result, or None with the failure noted: one run that
  fails or times out costs its own record, not the others'."""
  try:
    return run()
  except (RuntimeError, TimeoutError) as e:
    failures.append(f"{what}: {e}")
    print(f"  FAILED {what}: {str(e).splitlines()[0]}", flush=True)
    return None


def compute_only(
    model: str, compressors, workers: int, steps: int, timeout: float
) -> dict[str, dict[str, Any]]:
  """Per compressor, the step seconds of ``workers`` lone processes run at
  once, one device each: the slowest one's median step."""
  out = {}
  for name in compressors:
    args = [f"--workload={model}", f"--compressor={name}", f"--steps={steps}"]
    results = _launch([_jax_cmd("train", *args)] * workers, timeout)
    # A synchronous step waits for the slowest worker.
    batch = workloads.CLUSTER_MODELS[model]["batch_size"]
    seconds = max(batch / r["examples_per_sec"] for r in results)
    out[name] = seconds
    print(f"  compute only, {name}: {seconds * 1e3:.0f} ms/step", flush=True)
  return out


def calibrate(
    network: links.Network, timeout: float
) -> tuple[costmodel.Link, list[float]]:
  """Fits alpha and beta to psum times on ``network``; returns the link and
  the slowest worker's seconds per size of ``PSUM_SIZES``."""
  sizes = ",".join(str(s) for s in PSUM_SIZES)
  results = _on_network(
      network,
      lambda i: _jax_cmd("psum", f"--sizes={sizes}", *_distributed(network, i)),
      timeout,
  )
  seconds = [
      max(r["psum_seconds"][str(s)] for r in results) for s in PSUM_SIZES
  ]
  link = costmodel.fit_all_reduce(PSUM_SIZES, seconds, len(network.names))
  return link, seconds


def traffic(model: str, compressor: str) -> list[costmodel.Traffic]:
  """What each phase of the train step sends, read from its compiled HLO
  (XLA:CPU's combiner fuses the all-reduces, as in the cluster run).

  Compiles for this process's devices, which must number the workers: the
  program is the same SPMD program the worker processes run.
  """
  import acp_jax
  from train import experiment as experiment_lib
  from train import train

  experiment = experiment_lib.build(
      workloads.cluster_config(model, compressor, 1)
  )
  train_fn, _ = train.compile_steps(experiment)
  batch = experiment_lib.abstract_batch(experiment)
  phases = []
  for state in experiment_lib.abstract_phase_states(experiment).values():
    stats = acp_jax.collective_stats(
        train_fn.lower(state, batch).compile().as_text()
    )
    if set(stats) - {"all-reduce", "all-gather"}:
      raise ValueError(f"unmodelled collectives in the step: {stats}")
    reduce_ops, reduce_bytes = stats.get("all-reduce", (0, 0))
    gather_ops, gather_bytes = stats.get("all-gather", (0, 0))
    phases.append(
        costmodel.Traffic(reduce_bytes, reduce_ops, gather_bytes, gather_ops)
    )
  return phases


def _predict(step: float, phases, workers: int, link, batch: int) -> float:
  """Examples/s the model predicts: the compute-only step plus each phase's
  communication, averaged over phases. XLA:CPU runs a step's thunks in
  order, so nothing is hidden behind backprop."""
  seconds = statistics.mean(step + t.seconds(workers, link) for t in phases)
  return batch * workers / seconds


def measure(
    model: str,
    workers: int,
    bandwidths: list[str],
    steps: int,
    timeout: float,
    with_torch: bool,
    compressors=workloads.COMPRESSORS,
    fastest_link_only=FASTEST_LINK_ONLY,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
  """Cluster records (one per system, compressor and bandwidth), link
  calibration records (one per bandwidth and psum size) and the runs that
  failed, each with its reason. The
  ``fastest_link_only`` compressors run on the last bandwidth only."""
  batch = workloads.CLUSTER_MODELS[model]["batch_size"]
  print(f"{workers} processes, compute only:", flush=True)
  alone = compute_only(model, compressors, workers, steps, timeout)
  phases = {c: traffic(model, c) for c in compressors}
  runs, calibration, failures = [], [], []
  for bandwidth in bandwidths:
    with links.switched(workers, BANDWIDTHS[bandwidth]) as network:
      link, seconds = calibrate(network, timeout)
      print(
          f"{bandwidth}: alpha {link.alpha * 1e6:.0f} us, beta"
          f" {1 / link.beta / 1e6:.0f} MB/s",
          flush=True,
      )
      calibration.extend(
          {
              "bandwidth": bandwidth,
              "workers": workers,
              "size_bytes": size,
              "psum_seconds": s,
              "alpha_s": link.alpha,
              "beta_s_per_byte": link.beta,
          }
          for size, s in zip(PSUM_SIZES, seconds)
      )
      base = {"bandwidth": bandwidth, "workers": workers, "model": model}
      last = bandwidth == bandwidths[-1]
      for name in compressors:
        if name in fastest_link_only and not last:
          continue
        with tempfile.TemporaryDirectory() as workdir:
          results = _attempt(
              failures,
              f"{bandwidth} acp_jax {name}",
              lambda: _on_network(
                  network,
                  lambda i: _jax_cmd(
                      "train",
                      f"--workload={model}",
                      f"--compressor={name}",
                      f"--steps={steps}",
                      f"--workdir={workdir}",
                      *_distributed(network, i),
                  ),
                  timeout,
              ),
          )
        if results is None:
          continue
        step = alone[name]
        predicted = _predict(step, phases[name], workers, link, batch)
        runs.append(
            {
                **base,
                "system": "acp_jax",
                "compressor": name,
                "examples_per_sec": results[0]["examples_per_sec"],
                "predicted_examples_per_sec": predicted,
                "compute_only_examples_per_sec": batch * workers / step,
                "bytes_per_step": statistics.mean(
                    results[0]["bytes_per_phase"]
                ),
                "params_identical": (
                    len({r["params_sha256"] for r in results}) == 1
                ),
            }
        )
        _show(runs[-1])
      for name in TORCH if with_torch else ():
        results = _attempt(
            failures,
            f"{bandwidth} torch {name}",
            lambda: _on_network(
                network,
                lambda i: [sys.executable]
                + _torch_args(model, name, steps)
                + [
                    f"--master_addr={network.address(0)}",
                    "--master_port=29500",
                    f"--world_size={workers}",
                    f"--process_id={i}",
                    # As torchrun: one thread per process when the cores
                    # are shared (torch's spinning threads oversubscribe).
                    f"--threads={max(1, os.cpu_count() // workers)}",
                ],
                timeout,
            ),
        )
        if results is None:
          continue
        runs.append(
            {
                **base,
                "system": "torch",
                "compressor": name,
                "examples_per_sec": results[0]["examples_per_sec"],
                "params_identical": (
                    len({r["params_sha256"] for r in results}) == 1
                ),
            }
        )
        _show(runs[-1])
  return runs, calibration, failures


# (compressor, hierarchical): hierarchical ACP-SGD against flat ACP-SGD,
# whose ring over all devices crosses the slow links, and flat S-SGD.
HIERARCHICAL_RUNS = (("acp_sgd", True), ("acp_sgd", False), ("ssgd", False))


def measure_hierarchical(
    model: str,
    nodes: int,
    devices: int,
    bandwidths: list[str],
    steps: int,
    timeout: float,
) -> tuple[list[dict[str, Any]], list[str]]:
  """Records of ``nodes`` processes of ``devices`` devices each, one node
  per namespace, so that only traffic between nodes crosses the shaped
  links; and the runs that failed. Each record has the examples/s (the
  median step), the bytes each node sent on its link per step (counted on
  the interface), and the accounting per device on each mesh axis."""
  runs, failures = [], []
  for bandwidth in bandwidths:
    with links.switched(nodes, BANDWIDTHS[bandwidth]) as network:
      for name, hierarchical in HIERARCHICAL_RUNS:
        mode = "hierarchical" if hierarchical else "flat"
        results = _attempt(
            failures,
            f"{bandwidth} {mode} {name}",
            lambda: _on_network(
                network,
                lambda i: _jax_cmd(
                    "nodes",
                    f"--workload={model}",
                    f"--compressor={name}",
                    f"--steps={steps}",
                    f"--devices={devices}",
                    "--link=eth0",
                    *(["--hierarchical"] if hierarchical else []),
                    *_distributed(network, i),
                ),
                timeout,
            ),
        )
        if results is None:
          continue
        runs.append(
            {
                "bandwidth": bandwidth,
                "nodes": nodes,
                "devices_per_node": devices,
                "model": model,
                "compressor": name,
                "mode": mode,
                "examples_per_sec": min(
                    r["examples_per_sec"] for r in results
                ),
                "slow_link_bytes_per_step": statistics.mean(
                    r["link_tx_bytes_per_step"] for r in results
                ),
                "node_axis_bytes_per_device": results[0][
                    "node_axis_bytes_per_device"
                ],
                "local_axis_bytes_per_device": results[0][
                    "local_axis_bytes_per_device"
                ],
                "params_identical": (
                    len({r["params_sha256"] for r in results}) == 1
                ),
            }
        )
        print(
            f"  {bandwidth} {mode} {name}:"
            f" {runs[-1]['examples_per_sec']:.2f} examples/s,"
            f" {runs[-1]['slow_link_bytes_per_step'] / 1e6:.3f} MB/step on"
            " each node's link",
            flush=True,
        )
  return runs, failures


def _show(run: dict[str, Any]) -> None:
  predicted = run.get("predicted_examples_per_sec")
  extra = f" (model: {predicted:.2f})" if predicted else ""
  print(
      f"  {run['system']} {run['compressor']}:"
      f" {run['examples_per_sec']:.2f} examples/s{extra}",
      flush=True,
  )


COLUMNS = {
    "bandwidth": "link",
    "system": "system",
    "compressor": "compressor",
    "examples_per_sec": "examples/s",
    "predicted_examples_per_sec": "model",
    "compute_only_examples_per_sec": "compute only",
    "params_identical": "same params",
}

HIERARCHICAL_COLUMNS = {
    "bandwidth": "link",
    "mode": "mode",
    "compressor": "compressor",
    "examples_per_sec": "examples/s",
    "slow_link_bytes_per_step": "bytes/step on a node's link",
    "node_axis_bytes_per_device": "accounted, node axis",
    "local_axis_bytes_per_device": "accounted, local axis",
    "params_identical": "same params",
}
