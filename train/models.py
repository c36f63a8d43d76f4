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
import jax.numpy as jnp
from flax import nnx

# PyTorch's kaiming_normal_(mode="fan_out", nonlinearity="relu"), which
# torchvision uses for every conv in ResNet and VGG.
_conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def _check_dropout_rngs(model, rate, train, rngs):
  # nnx.Dropout's own error on a missing key does not say which argument to
  # pass; fail early with one that does.
  if train and rate > 0 and rngs is None:
    raise ValueError(
        f"{type(model).__name__} has dropout={rate} and train=True, so it"
        " needs rngs=nnx.Rngs(dropout=key) at call time; got rngs=None"
    )


def _conv(in_ch, out_ch, kernel, *, strides=1, use_bias=False, rngs):
  # Symmetric padding k // 2 as in PyTorch: "SAME" pads strided convs
  # asymmetrically, which would shift every feature map by one pixel.
  pad = kernel // 2
  return nnx.Conv(
      in_ch,
      out_ch,
      (kernel, kernel),
      strides=strides,
      padding=((pad, pad), (pad, pad)),
      use_bias=use_bias,
      kernel_init=_conv_init,
      rngs=rngs,
  )


def _batch_norm(num_features, axis_name, rngs):
  return nnx.BatchNorm(
      num_features,
      momentum=0.9,
      epsilon=1e-5,
      axis_name=axis_name,
      rngs=rngs,
  )


# ---------------------------------------------------------------- ResNet


class ConvBN(nnx.Module):
  """A bias-free conv followed by BatchNorm."""

  def __init__(
      self, in_ch, out_ch, kernel, *, strides=1, batch_norm_axis, rngs
  ):
    self.conv = _conv(in_ch, out_ch, kernel, strides=strides, rngs=rngs)
    self.bn = _batch_norm(out_ch, batch_norm_axis, rngs)

  def __call__(self, x, *, train):
    return self.bn(self.conv(x), use_running_average=not train)


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


# ------------------------------------------------------------------ VGG

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
        convs.append(_conv(in_ch, c, 3, use_bias=True, rngs=rngs))
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
    _check_dropout_rngs(self, self.dropout_rate, train, rngs)
    x = x.reshape(x.shape[0], -1)
    for fc in (self.fc1, self.fc2):
      x = self.dropout(jax.nn.relu(fc(x)), deterministic=not train, rngs=rngs)
    return self.fc3(x)


# ---------------------------------------------------------- Transformers


class SelfAttention(nnx.Module):
  """Multi-head self-attention with biased q, k, v and output projections.

  Written out rather than `nnx.MultiHeadAttention`, whose kernels are 3-D
  (in, heads, head_dim): here each projection is one (dim, dim) matrix, as in
  PyTorch, so low-rank compressors see the same matrices as the reference
  implementations do.
  """

  def __init__(self, dim, num_heads, dropout, *, causal, rngs):
    if dim % num_heads:
      raise ValueError(
          f"hidden size {dim} must be divisible by num_heads {num_heads}"
      )
    self.num_heads = num_heads
    self.causal = causal
    init = nnx.initializers.normal(0.02)
    self.query = nnx.Linear(dim, dim, kernel_init=init, rngs=rngs)
    self.key = nnx.Linear(dim, dim, kernel_init=init, rngs=rngs)
    self.value = nnx.Linear(dim, dim, kernel_init=init, rngs=rngs)
    self.out = nnx.Linear(dim, dim, kernel_init=init, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, *, train, rngs):
    b, l, d = x.shape
    shape = (b, l, self.num_heads, d // self.num_heads)
    q = self.query(x).reshape(shape)
    k = self.key(x).reshape(shape)
    v = self.value(x).reshape(shape)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(shape[-1])
    if self.causal:
      mask = jnp.tril(jnp.ones((l, l), bool))
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = self.dropout(probs, deterministic=not train, rngs=rngs)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, l, d))


class BertLayer(nnx.Module):
  """Post-LN encoder layer of the original BERT."""

  def __init__(self, hidden, heads, ffn, dropout, *, rngs):
    init = nnx.initializers.normal(0.02)
    self.attention = SelfAttention(
        hidden, heads, dropout, causal=False, rngs=rngs
    )
    self.attention_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.ffn_in = nnx.Linear(hidden, ffn, kernel_init=init, rngs=rngs)
    self.ffn_out = nnx.Linear(ffn, hidden, kernel_init=init, rngs=rngs)
    self.ffn_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, *, train, rngs):
    det = not train
    y = self.attention(x, train=train, rngs=rngs)
    x = self.attention_norm(x + self.dropout(y, deterministic=det, rngs=rngs))
    # BERT uses the exact (erf) GELU, not the tanh approximation.
    y = self.ffn_out(jax.nn.gelu(self.ffn_in(x), approximate=False))
    return self.ffn_norm(x + self.dropout(y, deterministic=det, rngs=rngs))


BERT_SIZES = {
    "base": {"num_layers": 12, "hidden": 768, "heads": 12, "ffn": 3072},
    "large": {"num_layers": 24, "hidden": 1024, "heads": 16, "ffn": 4096},
}


class Bert(nnx.Module):
  """BERT encoder with the masked-LM head, as HuggingFace BertForMaskedLM.

  Maps int tokens [B, L] to logits [B, L, vocab_size]. There is no padding
  mask (every position attends to every other) and token-type ids are all 0.
  The decoder is tied to the word embeddings and has its own bias.

  Parameter count (V vocab, P max_len, T type_vocab_size, H hidden, F ffn,
  N layers):
    embeddings  (V + P + T) * H + 2H            (word, position, type, LN)
    each layer  4 * (H*H + H)                   (q, k, v, attention output)
                + (H*F + F) + (F*H + H)         (FFN)
                + 2 * 2H                        (two LayerNorms)
    MLM head    (H*H + H) + 2H + V              (transform, LN, decoder bias)
  base  (H=768,  F=3072, N=12): 23,837,184 + 12 * 7,087,872 + 622,650
        = 109,514,298;
  large (H=1024, F=4096, N=24): 31,782,912 + 24 * 12,596,224 + 1,082,170
        = 335,174,458.

  Args:
    rngs: initialization randomness; not kept.
    batch_norm_axis: ignored (no BN).
    size: "base", "large", or a dict with keys num_layers, hidden, heads, ffn
      (for small test configurations).
    vocab_size: number of token ids.
    max_len: number of learned positions.
    type_vocab_size: number of token-type embeddings (only type 0 is used,
      but all are kept so the count matches the reference).
    dropout: rate for embeddings, attention probabilities and residual
      branches.
  """

  def __init__(
      self,
      *,
      rngs: nnx.Rngs,
      batch_norm_axis: str | None = None,
      size: str | dict[str, int] = "base",
      vocab_size: int = 30522,
      max_len: int = 512,
      type_vocab_size: int = 2,
      dropout: float = 0.1,
  ):
    del batch_norm_axis
    if isinstance(size, str):
      if size not in BERT_SIZES:
        raise ValueError(
            f"size must be one of {sorted(BERT_SIZES)} or a dict, got {size!r}"
        )
      cfg = BERT_SIZES[size]
    else:
      cfg = dict(size)
      keys = sorted(BERT_SIZES["base"])
      if sorted(cfg) != keys:
        raise ValueError(
            f"size dict must have exactly the keys {keys}, got {sorted(cfg)}"
        )
    hidden = cfg["hidden"]
    init = nnx.initializers.normal(0.02)
    self.max_len = max_len
    self.dropout_rate = dropout
    self.word_embed = nnx.Embed(
        vocab_size, hidden, embedding_init=init, rngs=rngs
    )
    self.position_embed = nnx.Embed(
        max_len, hidden, embedding_init=init, rngs=rngs
    )
    self.type_embed = nnx.Embed(
        type_vocab_size, hidden, embedding_init=init, rngs=rngs
    )
    self.embed_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)
    self.layers = nnx.List(
        [
            BertLayer(hidden, cfg["heads"], cfg["ffn"], dropout, rngs=rngs)
            for _ in range(cfg["num_layers"])
        ]
    )
    self.mlm_dense = nnx.Linear(hidden, hidden, kernel_init=init, rngs=rngs)
    self.mlm_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.mlm_bias = nnx.Param(jnp.zeros((vocab_size,), jnp.float32))

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    _check_dropout_rngs(self, self.dropout_rate, train, rngs)
    length = inputs.shape[1]
    if length > self.max_len:
      raise ValueError(
          f"sequence length {length} exceeds max_len {self.max_len}"
      )
    x = (
        self.word_embed(inputs)
        + self.position_embed(jnp.arange(length))
        + self.type_embed.embedding[0]
    )
    x = self.dropout(self.embed_norm(x), deterministic=not train, rngs=rngs)
    for layer in self.layers:
      x = layer(x, train=train, rngs=rngs)
    x = self.mlm_norm(jax.nn.gelu(self.mlm_dense(x), approximate=False))
    return self.word_embed.attend(x) + self.mlm_bias[...]


class CharLMBlock(nnx.Module):
  """Pre-LN causal decoder block."""

  def __init__(self, dim, num_heads, dropout, *, rngs):
    init = nnx.initializers.normal(0.02)
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = SelfAttention(
        dim, num_heads, dropout, causal=True, rngs=rngs
    )
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, kernel_init=init, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, kernel_init=init, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, *, train, rngs):
    det = not train
    y = self.attention(self.attention_norm(x), train=train, rngs=rngs)
    x = x + self.dropout(y, deterministic=det, rngs=rngs)
    y = self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
    return x + self.dropout(y, deterministic=det, rngs=rngs)


class CharLM(nnx.Module):
  """Small GPT-style causal decoder for character language modelling.

  Maps int tokens [B, L] (L <= max_len) to next-token logits
  [B, L, vocab_size].

  Args:
    rngs: initialization randomness; not kept.
    batch_norm_axis: ignored (no BN).
    vocab_size: number of token ids.
    max_len: number of learned positions.
    dim: model width.
    num_layers: number of decoder blocks.
    num_heads: attention heads per block.
    dropout: rate for embeddings, attention probabilities and residual
      branches.
  """

  def __init__(
      self,
      *,
      rngs: nnx.Rngs,
      batch_norm_axis: str | None = None,
      vocab_size: int,
      max_len: int = 256,
      dim: int = 128,
      num_layers: int = 4,
      num_heads: int = 4,
      dropout: float = 0.0,
  ):
    del batch_norm_axis
    init = nnx.initializers.normal(0.02)
    self.max_len = max_len
    self.dropout_rate = dropout
    self.token_embed = nnx.Embed(
        vocab_size, dim, embedding_init=init, rngs=rngs
    )
    self.position_embed = nnx.Embed(
        max_len, dim, embedding_init=init, rngs=rngs
    )
    self.dropout = nnx.Dropout(dropout)
    self.blocks = nnx.List(
        [
            CharLMBlock(dim, num_heads, dropout, rngs=rngs)
            for _ in range(num_layers)
        ]
    )
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab_size, kernel_init=init, rngs=rngs)

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    _check_dropout_rngs(self, self.dropout_rate, train, rngs)
    length = inputs.shape[1]
    if length > self.max_len:
      raise ValueError(
          f"sequence length {length} exceeds max_len {self.max_len}"
      )
    x = self.token_embed(inputs) + self.position_embed(jnp.arange(length))
    x = self.dropout(x, deterministic=not train, rngs=rngs)
    for block in self.blocks:
      x = block(x, train=train, rngs=rngs)
    return self.head(self.final_norm(x))


# ------------------------------------------------------------ Small CNN


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
