"""A three-layer CNN for small images (8x8 digits, 28x28 MNIST)."""

import jax
import jax.numpy as jnp
from flax import nnx

from train.models.layers import ConvBN


class SmallCNN(nnx.Module):
  """Three conv-BN-ReLU layers for small images (8x8 digits, 28x28 MNIST).

  conv3x3(width), conv3x3(width), 2x2 average pool, conv3x3(2 * width),
  global average pool, linear head. Works on any spatial size >= 2.

  Args:
    rngs: initialization randomness; not kept.
    batch_norm_axis: mapped axis name to synchronize BN over, or None.
    num_classes: output width.
    width: channels of the first two convs.
  """

  def __init__(
      self,
      *,
      rngs: nnx.Rngs,
      batch_norm_axis: str | None = None,
      num_classes: int = 10,
      width: int = 32,
  ):
    self.layers = nnx.List(
        [
            ConvBN(c_in, c_out, 3, batch_norm_axis=batch_norm_axis, rngs=rngs)
            for c_in, c_out in [(1, width), (width, width), (width, 2 * width)]
        ]
    )
    self.fc = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    del rngs  # No dropout.
    x = jnp.asarray(inputs, jnp.float32)
    first, second, third = self.layers
    x = jax.nn.relu(second(jax.nn.relu(first(x, train=train)), train=train))
    x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    x = jax.nn.relu(third(x, train=train))
    return self.fc(jnp.mean(x, axis=(1, 2)))
