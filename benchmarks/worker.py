"""One JAX process of the cluster benchmark; ``benchmarks/cluster.py`` starts
N of them, one per network namespace, and reads the ``RESULT`` line each
prints.

  python -m benchmarks.worker train --workload W --compressor C --steps S \
      [--coordinator_address A --num_processes N --process_id I]
  python -m benchmarks.worker psum --sizes 4096,1048576 --repeats 5 \
      --coordinator_address A --num_processes N --process_id I
  python -m benchmarks.worker nodes --workload W --compressor C --steps S \
      --devices D [--hierarchical] [--link eth0] \
      --coordinator_address A --num_processes N --process_id I

``train`` runs the real train loop (``train.train_and_evaluate``) on one
CPU device per process; without a coordinator each process trains alone,
so its collectives move nothing: that is the compute-only baseline the cost
model starts from. ``psum`` times all-reduces of float32 buffers of the
given byte sizes, for calibrating the cost model on the links. ``nodes``
trains on ``D`` devices per process, each process a node of a (processes x
D) mesh: hierarchically (a dense mean within the process, the compressor
across processes) or flat (the compressor over all devices); with
``--link``, it counts the bytes that interface (its namespace's link to the
switch) sent and received per timed step.
"""

import argparse
import hashlib
import json
import pathlib
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
  nodes = sub.add_parser("nodes", parents=[common])
  nodes.add_argument("--workload", required=True)
  nodes.add_argument("--compressor", required=True)
  nodes.add_argument("--steps", type=int, required=True)
  nodes.add_argument("--devices", type=int, required=True, help="per process")
  nodes.add_argument(
      "--hierarchical",
      action="store_true",
      help="dense within a process, compressed across processes",
  )
  nodes.add_argument(
      "--link", help="network interface whose bytes to count, e.g. eth0"
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


def _link_bytes(interface: str | None) -> tuple[int, int] | None:
  """Bytes sent and received so far on ``interface``, or None."""
  if interface is None:
    return None
  stats = pathlib.Path("/sys/class/net", interface, "statistics")
  return tuple(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


def _nodes(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acp_jax
  from benchmarks import workloads
  from train import config as config_lib
  from train import experiment as experiment_lib

  config = workloads.cluster_config(args.workload, args.compressor, args.steps)
  # The model, data and optimizer of the workload; its 1-D mesh goes unused.
  experiment = experiment_lib.build(config)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if args.hierarchical:
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(jax.process_count(), -1), ("data", "local")
    )
    dp = acp_jax.DataParallel(experiment.compressor, mesh, local_axis="local")
  else:
    # Devices in process order: a ring over them crosses between processes
    # as rarely as a ring can.
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    dp = acp_jax.DataParallel(experiment.compressor, mesh)
  tx = dp.chain(config_lib.optimizer(config, experiment.schedule))
  graphdef, batch_stats = experiment.graphdef, experiment.abstract_batch_stats

  replicated = NamedSharding(mesh, P())
  params = jax.jit(
      lambda: nnx.to_pure_dict(
          nnx.split(experiment.create_model(), nnx.Param, ...)[1]
      ),
      out_shardings=replicated,
  )()
  # The same global batch every step, stacked [devices, per_device, ...];
  # each process puts its own devices' rows.
  rows = experiment.dataset.train.get(np.arange(experiment.global_batch))
  stacked = {
      k: v.reshape((dp.num_devices, -1) + v.shape[1:]) for k, v in rows.items()
  }
  batch = {
      k: jax.make_array_from_callback(
          v.shape,
          NamedSharding(mesh, dp.device_spec),
          lambda index, v=v: v[index],
      )
      for k, v in stacked.items()
  }

  def loss_fn(params, batch):
    batch = jax.tree.map(lambda x: x[0], batch)
    model = nnx.merge(graphdef, params, batch_stats)
    logits = model(
        batch["inputs"], train=True, rngs=nnx.Rngs(dropout=jax.random.key(0))
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]
    )
    weights = batch["weights"]
    return (loss * weights).sum() / jnp.maximum(weights.sum(), 1.0)

  @jax.jit
  def step(params, state, batch):
    loss, grads = dp.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  for _ in range(2):  # compiles each phase's program
    params, state, loss = jax.block_until_ready(step(params, state, batch))
  before, times = _link_bytes(args.link), []
  for _ in range(args.steps):
    start = time.perf_counter()
    params, state, loss = jax.block_until_ready(step(params, state, batch))
    times.append(time.perf_counter() - start)
  after = _link_bytes(args.link)
  volumes = dp.comm_bytes(experiment.abstract_params)
  per_axis = {
      axis: statistics.mean(v.total for v in phases.values())
      for axis, phases in volumes.items()
  }
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
  result = {
      "examples_per_sec": experiment.global_batch / statistics.median(times),
      "loss": float(loss),
      "params_sha256": digest.hexdigest(),
      "node_axis_bytes_per_device": per_axis["data"],
      "local_axis_bytes_per_device": per_axis.get("local", 0),
  }
  if before is not None:
    result["link_tx_bytes_per_step"] = (after[0] - before[0]) / args.steps
    result["link_rx_bytes_per_step"] = (after[1] - before[1]) / args.steps
  return result


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

  devices = args.devices if args.mode == "nodes" else 1
  runtime.setup(num_cpu_devices=devices, **{k: getattr(args, k) for k in _DIST})
  result = {"train": _train, "nodes": _nodes, "psum": _psum}[args.mode](args)
  print("RESULT " + json.dumps({"process_id": args.process_id, **result}))


if __name__ == "__main__":
  main()
