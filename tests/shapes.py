"""Parameter shapes of the paper's ResNets, as flax lays them out."""

import jax
import jax.numpy as jnp


def _conv(kh, kw, cin, cout):
  return {"kernel": jax.ShapeDtypeStruct((kh, kw, cin, cout), jnp.float32)}


def _bn(c):
  v = jax.ShapeDtypeStruct((c,), jnp.float32)
  return {"scale": v, "bias": v}


def resnet(blocks=(3, 4, 6, 3), width=64, num_classes=1000):
  """Bottleneck ResNet parameters (ResNet-50 by default; ResNet-152 is
  (3, 8, 36, 3)) as a tree of ``jax.ShapeDtypeStruct``. ``width`` scales
  every layer, for small stand-ins with the same structure."""
  params = {"stem": {"conv": _conv(7, 7, 3, width), "bn": _bn(width)}}
  cin = width
  for stage, n in enumerate(blocks):
    mid = width * 2**stage
    cout = 4 * mid
    for b in range(n):
      block = {
          "conv1": _conv(1, 1, cin, mid),
          "bn1": _bn(mid),
          "conv2": _conv(3, 3, mid, mid),
          "bn2": _bn(mid),
          "conv3": _conv(1, 1, mid, cout),
          "bn3": _bn(cout),
      }
      if b == 0:
        block["proj"] = {"conv": _conv(1, 1, cin, cout), "bn": _bn(cout)}
      params[f"stage{stage + 1}_block{b + 1}"] = block
      cin = cout
  params["head"] = {
      "kernel": jax.ShapeDtypeStruct((cin, num_classes), jnp.float32),
      "bias": jax.ShapeDtypeStruct((num_classes,), jnp.float32),
  }
  return params


def num_params(tree):
  return sum(x.size for x in jax.tree.leaves(tree))
