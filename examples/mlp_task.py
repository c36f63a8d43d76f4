"""The task both examples train: an MLP learning a random teacher's labels.

`nnx_plain.py` and `nnx_compressed.py` import it, so that what they differ
in is the loop alone.
"""

import jax
import numpy as np
import optax
from flax import nnx


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
