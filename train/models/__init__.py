"""Flax NNX models for the training experiments, built by name.

Every model is called as `model(inputs, *, train, rngs=None) -> logits`, holds
only `nnx.Param` and `nnx.BatchStat` state (no `nnx.Rngs` kept after
construction, so `nnx.split(model, nnx.Param, nnx.BatchStat)` is exhaustive),
and is float32 throughout. Dropout draws its randomness from the `rngs` passed
at call time (stream "dropout", else "default").

BatchNorm follows PyTorch's defaults (momentum 0.1 in PyTorch's convention,
i.e. 0.9 here; epsilon 1e-5). With `batch_norm_axis=None` statistics come from
the local batch only, as in PyTorch DDP; with an axis name (e.g. "data") they
are averaged over that mapped axis (synchronized BN).

Parameter counts match the reference implementations exactly (torchvision
ResNet/VGG with the ImageNet configuration, HuggingFace BertForMaskedLM), so
communication volumes measured on these models are comparable with papers.

Example:

  from flax import nnx
  from train import models

  model = models.create("resnet18", rngs=nnx.Rngs(0), num_classes=10,
                        stem="cifar")
  logits = model(images, train=True)  # images: [B, 32, 32, 3] float32
"""

from collections.abc import Callable
import inspect
import math
from typing import Any

import jax
from flax import nnx

from train.models.layers import ConvBN
from train.models.resnet import BasicBlock, Bottleneck, ResNet
from train.models.small_cnn import SmallCNN
from train.models.transformers import (
    BERT_SIZES,
    Bert,
    BertLayer,
    CharLM,
    CharLMBlock,
    SelfAttention,
)
from train.models.vgg import VGG16

__all__ = [
    "BERT_SIZES",
    "MODELS",
    "BasicBlock",
    "Bert",
    "BertLayer",
    "Bottleneck",
    "CharLM",
    "CharLMBlock",
    "ConvBN",
    "ResNet",
    "SelfAttention",
    "SmallCNN",
    "VGG16",
    "create",
    "num_params",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
]


def _constructor(name, cls, *args):
  """`cls` with `args` bound, under a signature `inspect` can read.

  NNX's metaclass shows every Module class as (*args, **kwargs) to
  `inspect.signature`; `create` and the trainer read the real keyword
  arguments from the entries of `MODELS`.
  """

  def constructor(**kwargs):
    return cls(*args, **kwargs)

  params = list(inspect.signature(cls.__init__).parameters.values())
  constructor.__signature__ = inspect.Signature(
      params[1 + len(args) :], return_annotation=cls
  )
  constructor.__name__ = constructor.__qualname__ = name
  constructor.__doc__ = f"Builds {name}; see `{cls.__name__}`."
  return constructor


resnet18 = _constructor("resnet18", ResNet, BasicBlock, (2, 2, 2, 2))
resnet34 = _constructor("resnet34", ResNet, BasicBlock, (3, 4, 6, 3))
resnet50 = _constructor("resnet50", ResNet, Bottleneck, (3, 4, 6, 3))
resnet152 = _constructor("resnet152", ResNet, Bottleneck, (3, 8, 36, 3))


# ------------------------------------------------------------- Registry

MODELS: dict[str, Callable[..., nnx.Module]] = {
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "vgg16": _constructor("vgg16", VGG16),
    "bert": _constructor("bert", Bert),
    "char_lm": _constructor("char_lm", CharLM),
    "small_cnn": _constructor("small_cnn", SmallCNN),
}


def create(
    name: str,
    *,
    rngs: nnx.Rngs,
    batch_norm_axis: str | None = None,
    **kwargs: Any,
) -> nnx.Module:
  """Builds the model registered under `name` in `MODELS`.

  Args:
    name: a key of `MODELS`.
    rngs: initialization randomness; the model does not keep it.
    batch_norm_axis: mapped axis to synchronize BatchNorm statistics over, or
      None for local-batch statistics. Ignored by models without BN. With a
      name, train-mode calls must run where that axis is bound (shard_map,
      pmap); evaluation uses running averages and runs anywhere.
    **kwargs: model-specific options (see each constructor).

  Returns:
    The model, called as `model(inputs, *, train, rngs=None)`.

  Raises:
    ValueError: `name` is not in `MODELS`.
    TypeError: a keyword argument is not accepted by that model.
  """
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; available: {sorted(MODELS)}")
  constructor = MODELS[name]
  accepted = set(inspect.signature(constructor).parameters)
  accepted -= {"rngs", "batch_norm_axis"}
  unknown = sorted(set(kwargs) - accepted)
  if unknown:
    raise TypeError(
        f"model {name!r} got unknown keyword arguments {unknown}; it accepts"
        f" {sorted(accepted)}"
    )
  return constructor(rngs=rngs, batch_norm_axis=batch_norm_axis, **kwargs)


def num_params(model_or_state) -> int:
  """Number of scalar elements in the `nnx.Param` variables.

  Args:
    model_or_state: an `nnx.Module` (concrete, or abstract from
      `nnx.eval_shape`), an `nnx.State`, or a pytree of arrays. In a State only
      `nnx.Param` variables count; a pytree of plain arrays counts whole.

  Returns:
    The parameter count.
  """
  if isinstance(model_or_state, nnx.Module):
    model_or_state = nnx.state(model_or_state, nnx.Param)
  leaves = jax.tree.leaves(
      model_or_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  total = 0
  for leaf in leaves:
    if isinstance(leaf, nnx.Variable):
      if not isinstance(leaf, nnx.Param):
        continue
      leaf = leaf.get_value()
    # Abstract models hold ShapeDtypeStructs, which np.shape cannot read.
    total += math.prod(getattr(leaf, "shape", ()))
  return total
