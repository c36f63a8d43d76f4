"""Top-k SGD: each device sends its k largest entries per leaf."""

import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from acp_jax import _checks
from acp_jax import buckets
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import phase as phase_lib
from acp_jax import error_feedback


class TopkSgdState(NamedTuple):
  """State of ``topk_sgd``.

  Attributes:
    error: residual e per leaf (the entries not sent yet), leaf shape and
      dtype; differs across devices.
  """

  error: optax.Updates


def _k(numel: int, density: float) -> int:
  return min(numel, max(1, math.ceil(density * numel)))  # 0 if numel = 0


def _block_start(flat: jax.Array) -> jax.Array | int:
  """The index in its whole leaf of ``flat``'s first element (within
  ``row_shards``, the padding rows come last, so it is the unpadded one)."""
  rows = collectives.row_axis()
  if rows is None:
    return 0
  return lax.axis_index(rows[0]) * flat.size


def _largest(flat: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k entries of largest magnitude of the whole leaf and their int32
  indices in it, largest first, from ``flat``, its elements (within
  ``collectives.row_shards``, this device's block of rows: the k largest
  of each block, gathered over the node, are cut to the node's k)."""
  kept = min(k, flat.size)
  index = lax.top_k(jnp.abs(flat), kept)[1]
  value = flat[index]
  if collectives.row_axis() is None:
    return value, index
  value = collectives.row_gather(value).ravel()
  index = collectives.row_gather(index + _block_start(flat)).ravel()
  top = lax.top_k(jnp.abs(value), k)[1]
  return value[top], index[top]


def _scatter(
    flat: jax.Array, index: jax.Array, value: jax.Array, how: str
) -> jax.Array:
  """``flat.at[index].set(value)`` or ``.add``, ``index`` into the whole
  leaf (within ``row_shards``, other blocks' entries are dropped)."""
  if collectives.row_axis() is not None:
    index = index - _block_start(flat)
    inside = (index >= 0) & (index < flat.size)
    index = jnp.where(inside, index, flat.size)
  return getattr(flat.at[index], how)(value, mode="drop")


def topk_sgd(
    density: float,
    *,
    axis_name: str = "data",
    bucket_bytes: float | None = None,
    leaf_order=None,
) -> compressor.Compressor:
  """Top-k sparsification with error feedback.

  Per leaf with d elements, k = max(1, ceil(density d)) (0 if d = 0)::

    p = g + e;  I = indices of the k largest |p|
    update = scatter_add over devices of (I, p[I]) / N;  e = p with p[I] = 0

  Values (leaf dtype) and int32 indices travel by all-gather, in buckets, so
  a device receives N k (itemsize + 4) bytes per leaf: less than a dense
  all-reduce only when the density is below about 1 / N.

  Args:
    density: fraction of each leaf's elements to send, in (0, 1].
    axis_name, bucket_bytes, leaf_order: as for ``sign_sgd``; each bucket's
      values and indices are all-gathered on their own.

  Returns:
    A ``Compressor``, whose update runs under ``jax.shard_map`` or
    ``jax.pmap`` over ``axis_name``.

  Example::

    tx = acp_jax.chain(acp_jax.topk_sgd(0.01), optax.sgd(0.1))

  .. warning::
    Put it first in the chain: it must see each device's own gradients.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018.
    https://arxiv.org/abs/1712.01887

    Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    https://arxiv.org/abs/1809.07599
  """
  args = _checks.bucketed_args(
      "topk_sgd", axis_name, bucket_bytes, leaf_order, density=density
  )

  def init(params):
    return TopkSgdState(error=error_feedback.zeros_like(params))

  def compress(ps):
    flats = [p.ravel() for p in ps]
    chosen = [
        _largest(f, _k(collectives.leaf_size(p, i), density))
        for i, (p, f) in enumerate(zip(ps, flats))
    ]
    gathered = collectives.bucketed_all_gather(
        [list(c) for c in chosen],
        buckets.leaf_plan(ps, args.bucket_bytes, args.leaf_order),
        axis_name,
        row_sums=[True] * len(ps),
    )
    sent, mean = [], []
    for p, f, (v, i), (all_v, all_i) in zip(ps, flats, chosen, gathered):
      sent.append(_scatter(jnp.zeros_like(f), i, v, "set").reshape(p.shape))
      total = _scatter(
          jnp.zeros(f.shape, jnp.float32),
          all_i.ravel(),
          all_v.ravel().astype(jnp.float32),
          "add",
      )
      mean.append((total / all_v.shape[0]).astype(p.dtype).reshape(p.shape))
    return sent, mean

  def update(updates, state):
    mean, error = error_feedback.apply(
        updates, state.error, compress, "topk_sgd"
    )
    return mean, TopkSgdState(error=error)

  def volume(params, num_devices):
    received = sum(
        _k(math.prod(x.shape), density) * (jnp.dtype(x.dtype).itemsize + 4)
        for x in jax.tree.leaves(params)
    )
    return {
        phase_lib.STEP: compressor.CommVolume(all_gather=num_devices * received)
    }

  return compressor.from_parts(args, TopkSgdState, init, update, volume)
