"""The paper's models on a GPU: compute times, and where XLA:GPU schedules
the step's collectives.

On the one GPU of this machine, for ResNet-50 (64 images of 224 x 224 per
GPU) and BERT-Base (32 sequences of 64 tokens per GPU), in float32 and
bfloat16:

- forward+backward: the gradient of the model's loss on one GPU's batch of
  synthetic data (params, BatchNorm statistics and float inputs cast to the
  dtype; the loss in float32), jitted;
- each compressor's update through ``DataParallel.compress`` on a
  one-device mesh, as ``overhead`` times it (its collectives move nothing),
  on gradients of the dtype.

Each is warmed up, then timed ``repeats`` times (``jax.block_until_ready``);
the median is reported.

Then the train step of each model is compiled for eight GPUs on this one
(``jax_mock_gpu_topology``, mock NCCL), with XLA's latency-hiding scheduler
on, and ``acp_jax_tools.hlo.scheduled_overlap`` reads from the scheduled
module how much compute sits between each collective's start and its done:
the backward pass a collective hides behind. Each model compiles in a
process of its own, since the topology is fixed when JAX's backend starts,
beside the timings.

The whole run keeps within ``TIME_LIMIT_S``; what does not fit gives a
record whose ``status`` says so. Without a GPU it does nothing.

  python -m benchmarks gpu [--quick]
  python -m benchmarks.gpu --schedule resnet50 --compressors ssgd,acp_sgd
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acp_jax_tools import timing
from benchmarks import cli
from benchmarks import workloads

MODELS = ("resnet50", "bert_base")
DTYPES = ("float32", "bfloat16")
# Slices x hosts x devices per host: one host of eight GPUs.
TOPOLOGY = "1x1x8"
# The methods whose exchange is an all-reduce, the one a pipelining runtime
# overlaps with backprop; Sign-SGD and Top-k all-gather.
SCHEDULE_COMPRESSORS = ("ssgd", "power_sgd", "acp_sgd")
SCHEDULER_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"
# The whole run, compiles included.
TIME_LIMIT_S = 480.0  # a measurement started before it may still finish


def unavailable() -> str | None:
  """Why this machine cannot run the GPU check, or None if it can."""
  backend = jax.default_backend()
  if backend != "gpu" or not jax.devices("gpu"):
    return f"no GPU (jax backend: {backend})"
  return None


def _cast(tree: Any, dtype) -> Any:
  """Floating-point leaves of ``tree`` as ``dtype``; the rest as they are."""
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      tree,
  )


def forward_backward_call(model: str, dtype: str):
  """A zero-argument call computing the gradient of ``model``'s loss on one
  device's batch (the config's per-device batch), in ``dtype``; and that
  batch size."""
  from train import experiment as experiment_lib
  from train import loss as loss_lib

  cfg = workloads.config(model, "ssgd")
  batch = cfg.per_device_batch_size or cfg.batch_size // jax.device_count()
  cfg.data.num_examples = batch
  experiment = experiment_lib.build(cfg)
  state = experiment_lib.init_state(experiment)
  batch_stats = state.batch_stats
  if cfg.batch_norm != "sync":  # one slice per device: take the first
    batch_stats = jax.tree.map(lambda x: x[0], batch_stats)
  device = jax.devices()[0]
  params, batch_stats = jax.device_put(
      _cast((state.params, batch_stats), dtype), device
  )
  del state
  data = jax.device_put(
      _cast(experiment.dataset.train.get(np.arange(batch)), dtype), device
  )
  key = jax.random.key(0)

  def loss_fn(params, batch_stats, data):
    model = nnx.merge(experiment.graphdef, params, batch_stats)
    logits = model(data["inputs"], train=True, rngs=nnx.Rngs(dropout=key))
    return loss_lib.mean_loss(logits, data)

  grad_fn = jax.jit(jax.grad(loss_fn))
  return lambda: grad_fn(params, batch_stats, data), batch


def update_calls(model: str, compressor: str, dtype: str) -> list[Any]:
  """``timing.phase_calls`` of ``compressor`` on ``model``'s parameter
  shapes in ``dtype``: one call per phase, to run in phase order."""
  params = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, dtype),
      workloads.experiment(model).abstract_params,
  )
  return timing.phase_calls(workloads.compressor(model, compressor), params)


def _medians(calls: dict[Any, Any], repeats: int) -> dict[Any, float]:
  times = timing.interleaved(calls, repeats)
  return {key: statistics.median(t) for key, t in times.items()}


def time_compute(
    models: Sequence[str],
    dtypes: Sequence[str],
    repeats: int,
    deadline: float,
) -> list[dict[str, Any]]:
  """Forward+backward and update records of ``models`` in ``dtypes``, each
  measured only while ``time.monotonic()`` is before ``deadline``."""
  rows = []

  def timed(row, measure):
    if time.monotonic() > deadline:
      rows.append({**row, "status": "skipped: time limit"})
      return
    start = time.monotonic()
    try:
      row.update(measure())
    except Exception as e:  # pylint: disable=broad-except
      row["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    else:
      row["status"] = "ok"
    row["wall_s"] = time.monotonic() - start
    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.append(row)

  # float32 first, which the projection reads; then each model in bfloat16.
  for dtype in dtypes:
    for model in models:

      def forward_backward():
        call, batch = forward_backward_call(model, dtype)
        seconds = _medians({0: call}, repeats)[0]
        return {"batch_per_device": batch, "seconds": seconds}

      base = {"model": model, "dtype": dtype, "repeats": repeats}
      timed({**base, "kind": "forward_backward"}, forward_backward)
      for compressor in workloads.COMPRESSORS:

        def update():
          calls = update_calls(model, compressor, dtype)
          phases = list(_medians(dict(enumerate(calls)), repeats).values())
          out = {"seconds": statistics.fmean(phases)}
          if len(phases) == 2:  # ACP-SGD's P-steps and Q-steps
            out.update(seconds_p=phases[0], seconds_q=phases[1])
          return out

        timed({**base, "kind": "update", "compressor": compressor}, update)
  return rows


def schedule(model: str, compressors: Sequence[str]) -> None:
  """Prints a ``RESULT`` line per async collective of ``model``'s train step
  compiled for ``TOPOLOGY``, for each compressor and phase.

  Sets the mock topology, so it must run before JAX's backend starts, in a
  process of its own.
  """
  jax.config.update("jax_mock_gpu_topology", TOPOLOGY)
  from acp_jax_tools import hlo
  from train import experiment as experiment_lib
  from train import train

  devices = int(TOPOLOGY.split("x")[-1])
  if jax.device_count() != devices:
    raise RuntimeError(
        f"the mock topology {TOPOLOGY} gave {jax.device_count()}"
        f" {jax.default_backend()} devices, not {devices}"
    )
  for compressor in compressors:
    experiment = experiment_lib.build(workloads.config(model, compressor))
    train_fn, _ = train.compile_steps(experiment)
    batch = experiment_lib.abstract_batch(experiment)
    for phase, state in experiment_lib.abstract_phase_states(
        experiment
    ).items():
      start = time.perf_counter()
      text = train_fn.lower(state, batch).compile().as_text()
      compile_s = time.perf_counter() - start
      collectives = hlo.scheduled_overlap(text)
      if not collectives:
        print(
            "RESULT "
            + json.dumps(
                {
                    "compressor": compressor,
                    "phase": phase,
                    "status": "no async collective in the scheduled step",
                }
            ),
            flush=True,
        )
      for c in collectives:
        result = {
            "compressor": compressor,
            "phase": phase,
            "devices": experiment.num_devices,
            "collective": c.name,
            "collective_kind": c.kind,
            "bytes": c.bytes,
            "compute_between": c.compute_between,
            "brackets_compute": c.compute_between > 0,
            "compile_s": compile_s,
            "status": "ok",
        }
        print("RESULT " + json.dumps(result), flush=True)


def _schedule_process(model: str, compressors: Sequence[str], log_dir: str):
  """Starts ``schedule(model, compressors)`` in a process of its own, its
  output in files of ``log_dir`` (a pipe nobody reads while the timings run
  could fill and stall it)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SCHEDULER_FLAG}".strip()
  # It only compiles: the GPU's memory stays with the timings.
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  with (
      open(os.path.join(log_dir, f"{model}.out"), "w") as out,
      open(os.path.join(log_dir, f"{model}.err"), "w") as err,
  ):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            f"--schedule={model}",
            f"--compressors={','.join(compressors)}",
        ],
        env=env,
        stdout=out,
        stderr=err,
    )


def _schedule_rows(model: str, process, log_dir: str, deadline: float):
  """The records a ``_schedule_process`` printed by ``deadline``."""
  try:
    process.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    status = "stopped: time limit"
  else:
    status = None
    if process.returncode:
      with open(os.path.join(log_dir, f"{model}.err")) as f:
        last = (f.read().strip().splitlines() or ["no message"])[-1]
      status = f"failed ({process.returncode}): {last[:200]}"
  with open(os.path.join(log_dir, f"{model}.out")) as f:
    rows = [
        {"kind": "schedule", "model": model, **json.loads(line[7:])}
        for line in f
        if line.startswith("RESULT ")
    ]
  if status:
    rows.append({"kind": "schedule", "model": model, "status": status})
  return rows


def measure(
    models: Sequence[str], quick: bool, time_limit: float = TIME_LIMIT_S
) -> list[dict[str, Any]]:
  """Every record of the GPU check, within ``time_limit`` seconds."""
  deadline = time.monotonic() + time_limit
  compressors = ("acp_sgd",) if quick else SCHEDULE_COMPRESSORS
  with tempfile.TemporaryDirectory() as log_dir:
    processes = {m: _schedule_process(m, compressors, log_dir) for m in models}
    try:
      rows = time_compute(
          models, DTYPES[:1] if quick else DTYPES, 3 if quick else 10, deadline
      )
      for model, process in processes.items():
        rows += _schedule_rows(model, process, log_dir, deadline)
    finally:
      for process in processes.values():
        if process.poll() is None:
          process.kill()
          process.wait()
  return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The timings, and per compiled step how many of its async collectives
  (and of their bytes) have compute between start and done."""
  out = [r for r in rows if r["kind"] != "schedule" or "collective" not in r]
  steps = {}
  for r in rows:
    if r["kind"] == "schedule" and "collective" in r:
      steps.setdefault((r["model"], r["compressor"], r["phase"]), []).append(r)
  for (model, compressor, phase), collectives in steps.items():
    out.append(
        {
            "kind": "schedule",
            "model": model,
            "compressor": compressor,
            "phase": phase,
            "collectives": len(collectives),
            "bracketing": sum(c["brackets_compute"] for c in collectives),
            "bytes_bracketing": sum(
                c["bytes"] for c in collectives if c["brackets_compute"]
            ),
            "bytes": sum(c["bytes"] for c in collectives),
            "status": "ok",
        }
    )
  return out


COLUMNS = {
    "kind": "kind",
    "model": "model",
    "dtype": "dtype",
    "compressor": "compressor",
    "phase": "phase",
    "seconds": "seconds (median)",
    "collectives": "async collectives",
    "bracketing": "with compute inside",
    "bytes_bracketing": "their bytes",
    "bytes": "of bytes",
    "status": "status",
}


def schedule_main(argv: list[str] | None = None) -> None:
  """``python -m benchmarks.gpu --schedule``: one model's schedules, in the
  process ``measure`` starts for it."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu")
  parser.add_argument("--schedule", choices=workloads.WORKLOADS, required=True)
  parser.add_argument("--compressors", default=",".join(SCHEDULE_COMPRESSORS))
  args = parser.parse_args(argv)
  schedule(args.schedule, args.compressors.split(","))


HELP = (
    "compute times and the scheduled 8-GPU step, on a GPU (skips without one)"
)


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  cli.add_models(
      parser, help="comma-separated workloads (default: resnet50,bert_base)"
  )


def main(args) -> None:
  reason = unavailable()
  if reason:
    print(f"gpu: skipped, {reason}")
    return
  meta = cli.start(args, None)  # on the GPU
  rows = measure(args.models or list(MODELS), args.quick)
  cli.finish(args, meta, {"gpu": rows}, summary(rows), COLUMNS)


if __name__ == "__main__":
  schedule_main()
