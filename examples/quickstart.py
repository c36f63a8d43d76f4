"""ACP-SGD against S-SGD on 8 simulated CPU devices, with jax.shard_map.

A two-layer MLP learns a random teacher network's labels; each device holds
its own shard of every batch. Prints final accuracy and bytes sent per step.

  python examples/quickstart.py
"""

import functools

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax

mesh = jax.make_mesh((8,), ("data",))
replicated = NamedSharding(mesh, P())
split = NamedSharding(mesh, P("data"))  # along the leading axis


def loss_fn(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, (logits.argmax(-1) == y).mean()


def make_step(tx):
  # check_vma=False: jax.grad then returns each device's own gradient (with
  # it, grad would all-reduce replicated params' gradients densely itself).
  @jax.jit
  @functools.partial(
      jax.shard_map,
      mesh=mesh,
      check_vma=False,
      in_specs=(P(), P("data"), P("data"), P("data")),
      out_specs=(P(), P("data"), P()),
  )
  def step(params, opt_state, x, y):
    opt_state = jax.tree.map(lambda a: a[0], opt_state)  # this device's
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = jax.lax.pmean(jnp.stack([loss, acc]), "data")
    return params, jax.tree.map(lambda a: a[None], opt_state), metrics

  return step


TEACHER = np.random.default_rng(1).standard_normal((64, 10)).astype(np.float32)


def data(seed, n):
  """Inputs and the teacher's labels."""
  x = np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float32)
  return x, (x @ TEACHER).argmax(-1)


def train(compressor, steps=300, batch=256):
  rng = np.random.default_rng(0)
  params = {
      "w1": rng.standard_normal((64, 256), np.float32) / 8,
      "b1": np.zeros(256, np.float32),
      "w2": rng.standard_normal((256, 10), np.float32) / 16,
      "b2": np.zeros(10, np.float32),
  }
  tx = optax.chain(compressor, optax.sgd(0.1, momentum=0.9))
  # Residuals differ across devices: one state per device, stacked.
  opt_state = jax.tree.map(lambda a: jnp.stack([a] * 8), tx.init(params))
  params, opt_state = jax.device_put((params, opt_state), (replicated, split))
  step = make_step(tx)
  x, y = data(seed=2, n=8192)
  for i in range(steps):
    idx = rng.choice(len(x), batch, replace=False)
    batch_x, batch_y = jax.device_put((x[idx], y[idx]), split)
    params, opt_state, metrics = step(params, opt_state, batch_x, batch_y)
    # Waiting each step avoids a deadlock of XLA:CPU's simulated devices
    # when many steps are queued on few cores.
    metrics = jax.block_until_ready(metrics)
  _, acc = loss_fn(params, *data(seed=3, n=2048))
  volume = acp_jax.comm_bytes(compressor, params, num_devices=8)
  mean_bytes = sum(v.total for v in volume.values()) / len(volume)
  return float(metrics[0]), float(acc), mean_bytes


if __name__ == "__main__":
  print(
      f"{'compressor':<12}{'train loss':>12}{'accuracy':>10}{'bytes/step':>12}"
  )
  for name, compressor in [
      ("ssgd", acp_jax.ssgd()),
      ("acp_sgd", acp_jax.acp_sgd(rank=4)),
  ]:
    loss, acc, nbytes = train(compressor)
    print(f"{name:<12}{loss:>12.4f}{acc:>10.3f}{nbytes:>12,.0f}")
