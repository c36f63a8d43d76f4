"""The loop of `nnx_plain.py`, its gradients compressed by ACP-SGD.

Each device differentiates its own shard of the batch; ACP-SGD sends one
rank-4 factor per matrix per step instead of the full gradient.

  python examples/nnx_compressed.py [STEPS]
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # simulated; drop it on GPUs

import optax  # pylint: disable=g-import-not-at-top
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from mlp_task import MLP, batch, loss_fn

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
