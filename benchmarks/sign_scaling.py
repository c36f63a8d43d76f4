"""How Sign-SGD's update time grows with the device count, against S-SGD.

One 2048 x 2048 float32 leaf, updated under ``jax.shard_map`` on 1, 2, 4
and 8 simulated CPU devices by Sign-SGD with error feedback, Sign-SGD with
majority vote and S-SGD. Each (device count, compressor) runs in a process
of its own, since the device count is fixed when JAX's backend starts, and
under a time limit, so a pathological case costs its own row only. The
update is jitted with the state donated, as in a train step; its compile
time (lowering included) is measured, then it is warmed up and timed
``repeats`` times; the median is reported. The gradients are random normal,
different on each device.

  python -m benchmarks sign_scaling [--devices 1,2,4,8] [--repeats 5]
  python -m benchmarks.sign_scaling --num_devices 4 --compressor sign_sgd
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import cli

SHAPE = (2048, 2048)
# Name in the table -> the factory's keyword arguments.
COMPRESSORS = {
    "sign_sgd": ("sign_sgd", {}),
    "sign_sgd_vote": ("sign_sgd", {"majority_vote": True}),
    "ssgd": ("ssgd", {}),
}
COLUMNS = {
    "num_devices": "devices",
    "compressor": "compressor",
    "update_s": "update s (median)",
    "compile_s": "compile s",
    "status": "status",
}


def time_update(
    num_devices: int, compressor: str, repeats: int
) -> dict[str, Any]:
  """Compile and update seconds of ``compressor`` on ``num_devices``.

  Starts JAX's backend with that many simulated CPU devices, so it runs once
  per process.
  """
  from train import runtime

  runtime.setup(num_cpu_devices=num_devices)
  import jax
  import numpy as np

  import acp_jax
  from acp_jax_tools import timing

  factory, kwargs = COMPRESSORS[compressor]
  tx = getattr(acp_jax, factory)(**kwargs)
  mesh = jax.make_mesh(
      (num_devices,), (tx.axis_name,), axis_types=(jax.sharding.AxisType.Auto,)
  )
  dp = acp_jax.DataParallel(tx, mesh)
  params = jax.ShapeDtypeStruct(SHAPE, np.float32)
  (abstract_grads,) = jax.tree.leaves(dp.abstract_local_grads(params))
  rng = np.random.default_rng(0)
  grads = jax.device_put(
      rng.standard_normal(abstract_grads.shape, np.float32),
      abstract_grads.sharding,
  )
  state = [dp.init_comm(params)]
  update = jax.jit(dp.compress, donate_argnums=(1,))
  start = time.perf_counter()
  compiled = update.lower(grads, state[0]).compile()
  compile_s = time.perf_counter() - start

  def call():
    updates, state[0] = compiled(grads, state[0])
    return updates

  times = timing.interleaved({compressor: call}, repeats, warmup=1)
  return {
      "update_s": statistics.median(times[compressor]),
      "compile_s": compile_s,
  }


def measure(
    device_counts: Sequence[int], repeats: int, timeout: float
) -> list[dict[str, Any]]:
  """One record per device count and compressor, each from its own process.

  A run that fails or passes ``timeout`` seconds gives a record without
  times whose ``status`` says so.
  """
  rows = []
  for num_devices in device_counts:
    for compressor in COMPRESSORS:
      row = {"num_devices": num_devices, "compressor": compressor}
      command = [
          sys.executable,
          "-m",
          "benchmarks.sign_scaling",
          f"--num_devices={num_devices}",
          f"--compressor={compressor}",
          f"--repeats={repeats}",
      ]
      try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout
        )
      except subprocess.TimeoutExpired:
        row["status"] = f"over {timeout:.0f} s"
      else:
        results = [
            l for l in done.stdout.splitlines() if l.startswith("RESULT ")
        ]
        if done.returncode or not results:
          tail = done.stderr.strip().splitlines()[-1:] or ["no RESULT line"]
          row["status"] = f"failed ({done.returncode}): {tail[0]}"
        else:
          row.update(json.loads(results[-1][len("RESULT ") :]), status="ok")
      print(json.dumps(row), file=sys.stderr, flush=True)
      rows.append(row)
  return rows


def one_run(argv: list[str] | None = None) -> None:
  """``python -m benchmarks.sign_scaling``: one device count and compressor,
  in the process ``measure`` starts for it."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.sign_scaling")
  parser.add_argument("--num_devices", type=int, required=True)
  parser.add_argument("--compressor", choices=COMPRESSORS, required=True)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  result = time_update(args.num_devices, args.compressor, args.repeats)
  print("RESULT " + json.dumps(result), flush=True)


HELP = "Sign-SGD's update time at 1 to 8 devices, against S-SGD"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--devices",
      type=cli.ints_at_least(1),
      help="comma-separated device counts (default: 1,2,4,8; 1,2 if --quick)",
  )
  parser.add_argument(
      "--repeats", type=cli.int_at_least(1), help="timed calls per run"
  )
  parser.add_argument(
      "--timeout", type=float, default=600, help="seconds per run"
  )


def main(args) -> None:
  # Each device count runs in a process of its own.
  meta = cli.start(args, 1)
  devices = args.devices or ([1, 2] if args.quick else [1, 2, 4, 8])
  repeats = args.repeats or (2 if args.quick else 5)
  rows = measure(devices, repeats, args.timeout)
  cli.finish(args, meta, {"sign_scaling": rows}, rows, COLUMNS)


if __name__ == "__main__":
  one_run()
