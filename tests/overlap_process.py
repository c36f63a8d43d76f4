"""One process of the overlapped-step tests, and the model they share.

  python -m tests.overlap_process --coordinator_address A \
      --num_processes N --process_id I

Each process holds one CPU device, the setting where the overlapped step
runs its exchanges beside the backward pass. For every compressor it trains
a three-block MLP from the same state with ``DataParallel.step`` fused and
overlapped, four steps across ACP-SGD's warm-up, a P- and a Q-step, and
prints ``RESULT <compressor> <largest difference of the params> <sha256 of
the overlapped params> <order of the exchanges>``.
"""

import argparse
import hashlib

import numpy as np

STEPS = 4
WIDTH = 16


def problem(seed: int = 0):
  """The MLP's params and a batch of 8 rows per device of 8."""
  rng = np.random.default_rng(seed)
  params = {
      f"w{i}": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 4
      for i in range(3)
  }
  params["b0"] = np.zeros(WIDTH, np.float32)
  x = rng.standard_normal((64, WIDTH)).astype(np.float32)
  y = rng.standard_normal((64, WIDTH)).astype(np.float32)
  return params, x, y


def blocks():
  """The MLP as three blocks; the last returns the device's loss."""
  import jax.numpy as jnp

  def first(p, carry, x, y):
    del carry, y
    return jnp.tanh(x @ p["w0"] + p["b0"])

  def middle(p, h, x, y):
    del x, y
    return jnp.tanh(h @ p["w1"])

  def last(p, h, x, y):
    del x
    return jnp.mean((h @ p["w2"] - y) ** 2)

  return [first, middle, last]


def compressors():
  """Every compressor, with settings that compress the MLP; ACP-SGD with a
  warm-up step, so that four steps cover the warm-up, a P- and a Q-step."""
  import acp_jax

  return {
      "ssgd": acp_jax.ssgd(),
      "sign_sgd": acp_jax.sign_sgd(),
      "topk_sgd": acp_jax.topk_sgd(0.3),
      "power_sgd": acp_jax.power_sgd(2),
      "acp_sgd": acp_jax.acp_sgd(2, warmup_steps=1),
  }


def fused_and_overlapped(dp, params, x, y, steps: int = STEPS):
  """Both steps' params after ``steps`` steps from the same state, and the
  overlapped step (its ``exchange_order`` after the run)."""
  import jax
  import jax.numpy as jnp
  import optax

  tx = optax.sgd(0.1, momentum=0.9)
  init = dp.chain(tx).init
  results, last = [], None
  for overlap in (False, True):
    step = dp.step(tx, blocks(), overlap=overlap)
    # The step donates its params and state.
    p = jax.tree.map(jnp.copy, params)
    state = init(p)
    for t in range(steps):
      state = dp.at_step(state, t)
      p, state, loss = step(p, state, x, y)
      float(loss)  # one step in flight: see the collective timeout
    results.append(jax.tree.map(np.asarray, p))
    last = step
  return results[0], results[1], last


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator_address", required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  args = parser.parse_args()

  from train import runtime

  runtime.setup(
      num_cpu_devices=1,
      coordinator_address=args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
      distributed_timeout_s=120,
  )

  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acp_jax

  mesh = jax.make_mesh(
      (jax.device_count(),),
      ("data",),
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  params, x, y = problem()

  def put(a, spec):
    return jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, spec), lambda index: a[index]
    )

  params = jax.tree.map(lambda a: put(a, P()), params)
  for name, compressor in compressors().items():
    dp = acp_jax.DataParallel(compressor, mesh)
    xs, ys = put(x, dp.device_spec), put(y, dp.device_spec)
    fused, overlapped, step = fused_and_overlapped(dp, params, xs, ys)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(overlapped))
    )
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(overlapped):
      digest.update(leaf.tobytes())
    order = ",".join(map(str, step.exchange_order))
    print(f"RESULT {name} {diff!r} {digest.hexdigest()} {order}", flush=True)


if __name__ == "__main__":
  main()
