"""VGG-16 without BatchNorm, as torchvision's `vgg16`."""

import jax
import jax.numpy as jnp
from flax import nnx

from train.models.layers import check_dropout_rngs, conv

_VGG16_CONVS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M")
_VGG16_CONVS += (512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nnx.Module):
  """VGG-16 without BN, as torchvision's `vgg16`, on NHWC inputs.

  Args:
    rngs: initialization randomness; not kept.
    batch_norm_axis: ignored (no BN).
    num_classes: output width.
    head: "imagenet" (224x224 input, 7x7x512 -> 4096 -> 4096 -> classes with
      ReLU and dropout) or "cifar" (32x32 input, 1x1x512 -> classes).
    dropout: dropout rate of the ImageNet head.
  """

  def __init__(
      self,
      *,
      rngs: nnx.Rngs,
      batch_norm_axis: str | None = None,
      num_classes: int = 1000,
      head: str = "imagenet",
      dropout: float = 0.5,
  ):
    del batch_norm_axis
    if head not in ("imagenet", "cifar"):
      raise ValueError(f'head must be "imagenet" or "cifar", got {head!r}')
    self.head = head
    self.dropout_rate = dropout
    convs = []
    in_ch = 3
    for c in _VGG16_CONVS:
      if c != "M":
        convs.append(conv(in_ch, c, 3, use_bias=True, rngs=rngs))
        in_ch = c
    self.convs = nnx.List(convs)

    # torchvision: Linear weights N(0, 0.01), biases 0.
    def linear(i, o):
      return nnx.Linear(
          i, o, kernel_init=nnx.initializers.normal(0.01), rngs=rngs
      )

    if head == "imagenet":
      self.fc1 = linear(7 * 7 * 512, 4096)
      self.fc2 = linear(4096, 4096)
      self.fc3 = linear(4096, num_classes)
      self.dropout = nnx.Dropout(dropout)
    else:
      self.fc = linear(512, num_classes)

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    x = jnp.asarray(inputs, jnp.float32)
    convs = iter(self.convs)
    for c in _VGG16_CONVS:
      if c == "M":
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
      else:
        x = jax.nn.relu(next(convs)(x))
    if self.head == "cifar":
      return self.fc(x.reshape(x.shape[0], -1))
    if x.shape[1:3] != (7, 7):
      raise ValueError(
          'VGG16 head="imagenet" needs 224x224 inputs (a 7x7 map before the'
          f" head), got inputs of shape {inputs.shape}"
      )
    check_dropout_rngs(self, self.dropout_rate, train, rngs)
    x = x.reshape(x.shape[0], -1)
    for fc in (self.fc1, self.fc2):
      x = self.dropout(jax.nn.relu(fc(x)), deterministic=not train, rngs=rngs)
    return self.fc3(x)
