"""One process of the hierarchical multi-process test: a node of the mesh.

  python -m tests.hierarchical_process --coordinator_address A \
      --num_processes N --process_id I --devices D

Trains a small MLP with hierarchical ACP-SGD on a (2, devices / 2) mesh
whose rows are nodes: with 2 processes each process is a node, and the
compressed exchange is the only traffic between them. Prints
``RESULT <sha256 of the params> <losses, comma-separated>``.
"""

import argparse
import hashlib

import numpy as np

STEPS = 6


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator_address", required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--devices", type=int, required=True)
  args = parser.parse_args()

  from train import runtime

  distributed = {}
  if args.num_processes > 1:
    distributed = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
        "distributed_timeout_s": 120,
    }
  runtime.setup(num_cpu_devices=args.devices, **distributed)

  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import optax

  import acp_jax

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.array(devices).reshape(2, -1)
  for row in grid:  # a node never spans two processes
    assert len({d.process_index for d in row}) == 1, grid
  mesh = jax.sharding.Mesh(grid, ("data", "local"))
  dp = acp_jax.DataParallel(acp_jax.acp_sgd(2), mesh, local_axis="local")
  tx = dp.chain(optax.sgd(0.1, momentum=0.9))

  rng = np.random.default_rng(0)
  x = rng.standard_normal((32, 12)).astype(np.float32)
  y = rng.integers(0, 5, 32)
  params = {
      "w1": rng.standard_normal((12, 32)).astype(np.float32) / 4,
      "b1": np.zeros(32, np.float32),
      "w2": rng.standard_normal((32, 5)).astype(np.float32) / 6,
  }

  def put(a, spec):
    return jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, spec), lambda index: a[index]
    )

  params = jax.tree.map(lambda a: put(a, P()), params)
  x, y = put(x, dp.device_spec), put(y, dp.device_spec)

  def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, state, x, y):
    loss, grads = dp.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state, x, y)
    losses.append(float(loss))
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
  print(f"RESULT {digest.hexdigest()} {','.join(repr(l) for l in losses)}")


if __name__ == "__main__":
  main()
