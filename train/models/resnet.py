"""ResNet v1.5 as in torchvision (BasicBlock and Bottleneck variants)."""

import jax
import jax.numpy as jnp
from flax import nnx

from train.models.layers import ConvBN


class _Residual(nnx.Module):
  """ConvBN layers with ReLUs between, plus a shortcut, then ReLU.

  The stride sits on the first 3x3 conv (torchvision v1.5: in a Bottleneck,
  the 3x3, not the first 1x1 as in the original paper); a 1x1 ConvBN
  projects the shortcut when the shape changes.
  """

  kernels: tuple[int, ...]
  expansion: int

  def __init__(self, in_ch, ch, strides, *, batch_norm_axis, rngs):
    out_ch = ch * self.expansion
    widths = [ch] * (len(self.kernels) - 1) + [out_ch]
    first_3x3 = self.kernels.index(3)
    layers, width_in = [], in_ch
    for i, (kernel, width) in enumerate(zip(self.kernels, widths)):
      layers.append(
          ConvBN(
              width_in,
              width,
              kernel,
              strides=strides if i == first_3x3 else 1,
              batch_norm_axis=batch_norm_axis,
              rngs=rngs,
          )
      )
      width_in = width
    self.layers = nnx.List(layers)
    # Assigned once: NNX makes an attribute that first holds None static.
    self.projection = (
        ConvBN(
            in_ch,
            out_ch,
            1,
            strides=strides,
            batch_norm_axis=batch_norm_axis,
            rngs=rngs,
        )
        if strides != 1 or in_ch != out_ch
        else None
    )

  def __call__(self, x, *, train):
    y = x
    for layer in self.layers[:-1]:
      y = jax.nn.relu(layer(y, train=train))
    y = self.layers[-1](y, train=train)
    shortcut = x if self.projection is None else self.projection(x, train=train)
    return jax.nn.relu(y + shortcut)


class BasicBlock(_Residual):
  """Two 3x3 convs (ResNet-18/34)."""

  kernels = (3, 3)
  expansion = 1


class Bottleneck(_Residual):
  """1x1-3x3-1x1 convs (ResNet-50/101/152), torchvision v1.5."""

  kernels = (1, 3, 1)
  expansion = 4


class ResNet(nnx.Module):
  """ResNet v1.5 as in torchvision, on NHWC inputs.

  Args:
    block: `BasicBlock` or `Bottleneck`.
    stage_sizes: number of blocks in each of the four stages.
    rngs: initialization randomness; not kept.
    batch_norm_axis: mapped axis name to synchronize BN over, or None.
    num_classes: width of the linear head.
    stem: "imagenet" (7x7/2 conv, 3x3/2 max-pool) or "cifar" (3x3/1 conv, no
      pool) for 32x32 inputs.
  """

  def __init__(
      self,
      block: type[BasicBlock] | type[Bottleneck],
      stage_sizes: tuple[int, ...],
      *,
      rngs: nnx.Rngs,
      batch_norm_axis: str | None = None,
      num_classes: int = 1000,
      stem: str = "imagenet",
  ):
    if stem not in ("imagenet", "cifar"):
      raise ValueError(f'stem must be "imagenet" or "cifar", got {stem!r}')
    self.stem = stem
    self.stem_layer = ConvBN(
        3,
        64,
        7 if stem == "imagenet" else 3,
        strides=2 if stem == "imagenet" else 1,
        batch_norm_axis=batch_norm_axis,
        rngs=rngs,
    )
    blocks = []
    in_ch = 64
    for i, num_blocks in enumerate(stage_sizes):
      ch = 64 * 2**i
      for j in range(num_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        blocks.append(
            block(
                in_ch, ch, strides, batch_norm_axis=batch_norm_axis, rngs=rngs
            )
        )
        in_ch = ch * block.expansion
    self.blocks = nnx.List(blocks)
    self.fc = nnx.Linear(in_ch, num_classes, rngs=rngs)

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    del rngs  # No dropout in ResNet.
    x = jnp.asarray(inputs, jnp.float32)
    x = jax.nn.relu(self.stem_layer(x, train=train))
    if self.stem == "imagenet":
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in self.blocks:
      x = block(x, train=train)
    return self.fc(jnp.mean(x, axis=(1, 2)))
