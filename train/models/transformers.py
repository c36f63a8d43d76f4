"""Transformers: the BERT masked-LM encoder and a small causal char LM.

Both use `SelfAttention`, whose projections are plain (dim, dim) matrices as
in PyTorch, so low-rank compressors see the reference implementations'
matrices.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from train.models.layers import check_dropout_rngs


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


def _positions(inputs, max_len: int) -> jax.Array:
  """The positions ``0 .. L-1`` of ``inputs`` ``[B, L]``; raises if ``L``
  exceeds the ``max_len`` learned positions."""
  length = inputs.shape[1]
  if length > max_len:
    raise ValueError(f"sequence length {length} exceeds max_len {max_len}")
  return jnp.arange(length)


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

  def stages(self, *, train: bool, rngs: nnx.Rngs | None = None) -> list:
    """The forward pass as functions applied in turn, tokens to logits: the
    embeddings, each layer, the masked-LM head (the blocks of an
    overlapped step, ``acp_jax.DataParallel.step``)."""
    check_dropout_rngs(self, self.dropout_rate, train, rngs)

    def embed(inputs):
      positions = _positions(inputs, self.max_len)
      x = (
          self.word_embed(inputs)
          + self.position_embed(positions)
          + self.type_embed.embedding[0]
      )
      return self.dropout(
          self.embed_norm(x), deterministic=not train, rngs=rngs
      )

    def head(x):
      x = self.mlm_norm(jax.nn.gelu(self.mlm_dense(x), approximate=False))
      return self.word_embed.attend(x) + self.mlm_bias[...]

    layers = [
        functools.partial(layer, train=train, rngs=rngs)
        for layer in self.layers
    ]
    return [embed, *layers, head]

  def __call__(self, inputs, *, train: bool, rngs: nnx.Rngs | None = None):
    x = inputs
    for stage in self.stages(train=train, rngs=rngs):
      x = stage(x)
    return x


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
    check_dropout_rngs(self, self.dropout_rate, train, rngs)
    positions = _positions(inputs, self.max_len)
    x = self.token_embed(inputs) + self.position_embed(positions)
    x = self.dropout(x, deterministic=not train, rngs=rngs)
    for block in self.blocks:
      x = block(x, train=train, rngs=rngs)
    return self.head(self.final_norm(x))
