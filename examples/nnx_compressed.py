"""The loop of `nnx_plain.py`, its gradients compressed by ACP-SGD.

Each device differentiates its own shard of the batch; ACP-SGD sends one
rank-4 factor per matrix per step instead of the full gradient.

  python examples/nnx_compressed.py [STEPS]
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # simulated; drop it on GPUs

import numpy as np  # pylint: disable=g-import-not-at-top
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(64, 256, rngs=rngs)
    self.out = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


TEACHER = np.random.default_rng(1).standard_normal((64, 10)).astype(np.float32)


def batch(step, size=256):
  """Inputs and a random teacher network's labels."""
  x = np.random.default_rng(step).standard_normal((size, 64), np.float32)
  return x, (x @ TEACHER).argmax(-1)


mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
dp = acp_jax.DataParallel(acp_jax.acp_sgd(rank=4), mesh)
model = MLP(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, dp.chain(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = dp.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for step in range(steps):
  x, y = jax.device_put(batch(step), NamedSharding(mesh, P("data")))
  loss = float(train_step(model, optimizer, x, y))  # waits for each step
x, y = batch(steps, 2048)
print(f"loss {loss:.4f}, held-out accuracy {(model(x).argmax(-1) == y).mean():.3f}")
