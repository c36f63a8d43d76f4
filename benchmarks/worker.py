"""One JAX process of the cluster benchmark; ``benchmarks/cluster.py`` starts
N of them, one per network namespace, and reads the ``RESULT`` line each
prints.

  python -m benchmarks.worker train --workload W --compressor C --steps S \
      [--coordinator_address A --num_processes N --process_id I]
  python -m benchmarks.worker psum --sizes 4096,1048576 --repeats 5 \
      --coordinator_address A --num_processes N --process_id I

``train`` runs the real train loop (``train.train_and_evaluate``) on one
CPU device per process; without a coordinator each process trains alone,
so its collectives move nothing: that is the compute-only baseline the cost
model starts from. ``psum`` times all-reduces of float32 buffers of the
given byte sizes, for calibrating the cost model on the links.
"""

import argparse
import json
import statistics
import tempfile
import time

_DIST = ("coordinator_address", "num_processes", "process_id")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
  sub = parser.add_subparsers(dest="mode", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--coordinator_address")
  common.add_argument("--num_processes", type=int)
  common.add_argument("--process_id", type=int)
  train = sub.add_parser("train", parents=[common])
  train.add_argument("--workload", required=True)
  train.add_argument("--compressor", required=True)
  train.add_argument("--steps", type=int, required=True)
  train.add_argument(
      "--workdir", help="shared by the processes of a run (orbax)"
  )
  psum = sub.add_parser("psum", parents=[common])
  psum.add_argument("--sizes", required=True, help="comma-separated bytes")
  psum.add_argument("--repeats", type=int, default=5)
  return parser


def _train(args) -> dict:
  from benchmarks import workloads
  from train import train

  config = workloads.cluster_config(args.workload, args.compressor, args.steps)
  if args.workdir:
    summary = train.train_and_evaluate(config, args.workdir)
  else:
    with tempfile.TemporaryDirectory() as workdir:
      summary = train.train_and_evaluate(config, workdir)
  keys = ("examples_per_sec", "params_sha256", "bytes_per_phase", "loss")
  return {k: summary[k] for k in keys}


def _psum(args) -> dict:
  import jax
  from jax import lax
  import numpy as np

  sizes = [int(s) for s in args.sizes.split(",")]
  local = jax.local_devices()
  allreduce = jax.pmap(lambda x: lax.psum(x, "i"), axis_name="i")
  seconds = {}
  for size in sizes:
    x = np.ones((len(local), size // 4), np.float32)
    jax.block_until_ready(allreduce(x))  # compiles, connects
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(allreduce(x))
      times.append(time.perf_counter() - start)
    seconds[str(size)] = statistics.median(times)
  return {"psum_seconds": seconds}


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  from train import runtime

  runtime.setup(num_cpu_devices=1, **{k: getattr(args, k) for k in _DIST})
  result = _train(args) if args.mode == "train" else _psum(args)
  print("RESULT " + json.dumps({"process_id": args.process_id, **result}))


if __name__ == "__main__":
  main()
