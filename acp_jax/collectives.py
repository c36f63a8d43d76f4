"""Fused collectives over a named mapped axis.

Compressors hand these helpers a flat list of arrays. Arrays of one dtype are
packed into one flat buffer, so that a whole step's payload travels in a single
collective (a *fusion buffer*, as PyTorch DDP and Horovod call it) whatever the
backend's own combiner does, and the compiled HLO shows exactly one collective
per buffer.
"""

from collections.abc import Sequence
import math

import jax
from jax import lax
import jax.numpy as jnp

# PyTorch DDP's bucket size: a buffer this large is full, and can be sent,
# while backprop still computes the gradients of earlier layers.
DEFAULT_FUSION_BYTES = 25 * 2**20


def check_fusion_bytes(fusion_bytes) -> None:
  if fusion_bytes is not None and (
      isinstance(fusion_bytes, bool)
      or not isinstance(fusion_bytes, int)
      or fusion_bytes <= 0
  ):
    raise ValueError(
        f"fusion_bytes must be a positive int or None, got {fusion_bytes!r}"
    )


def axis_size(axis_name: str, caller: str) -> int:
  """Size of the mapped axis ``axis_name``; a clear error if it is unbound."""
  try:
    return lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not bound. Call the update"
        " inside a mapped step over that axis, e.g."
        f" jax.shard_map(step, mesh=jax.make_mesh((n,), ({axis_name!r},)),"
        f" ...) or jax.pmap(step, axis_name={axis_name!r})."
    ) from None


def _buckets(
    arrays: Sequence[jax.Array], fusion_bytes: int | None
) -> list[list[int]]:
  """Indices of ``arrays`` grouped into buffers of one dtype each.

  Arrays are taken in reverse order, the order in which backprop produces the
  gradients of a sequential model, and a buffer is closed once it would exceed
  ``fusion_bytes`` (``None``: no limit). An array larger than the limit gets a
  buffer of its own.
  """
  open_buckets: dict[jnp.dtype, tuple[list[int], int]] = {}
  closed = []
  for i in reversed(range(len(arrays))):
    x = arrays[i]
    nbytes = x.size * x.dtype.itemsize
    members, size = open_buckets.get(x.dtype, ([], 0))
    if members and fusion_bytes is not None and size + nbytes > fusion_bytes:
      closed.append(members)
      members, size = [], 0
    open_buckets[x.dtype] = (members + [i], size + nbytes)
  return closed + [members for members, _ in open_buckets.values()]


def _pack(arrays: Sequence[jax.Array]) -> jax.Array:
  return jnp.concatenate([x.ravel() for x in arrays])


def _unpack(
    flat: jax.Array, like: Sequence[jax.Array], lead: tuple[int, ...] = ()
) -> list[jax.Array]:
  """Splits the last axis of ``flat`` back into arrays shaped like ``like``."""
  offsets = [0]
  for x in like:
    offsets.append(offsets[-1] + x.size)
  return [
      flat[..., start:stop].reshape(lead + x.shape)
      for x, start, stop in zip(like, offsets[:-1], offsets[1:])
  ]


def fused_psum(
    arrays: Sequence[jax.Array],
    axis_name: str,
    fusion_bytes: int | None = None,
) -> list[jax.Array]:
  """``lax.psum`` of every array, one all-reduce per fusion buffer."""
  out = [None] * len(arrays)
  for bucket in _buckets(arrays, fusion_bytes):
    members = [arrays[i] for i in bucket]
    summed = lax.psum(_pack(members), axis_name)
    for i, x in zip(bucket, _unpack(summed, members)):
      out[i] = x
  return out


def fused_all_gather(
    arrays: Sequence[jax.Array], axis_name: str
) -> list[jax.Array]:
  """``lax.all_gather`` of every array, one all-gather per dtype.

  Returns arrays with a new leading axis of the axis size: entry ``j`` holds
  device ``j``'s array.
  """
  n = axis_size(axis_name, "fused_all_gather")
  out = [None] * len(arrays)
  for bucket in _buckets(arrays, None):
    members = [arrays[i] for i in bucket]
    gathered = lax.all_gather(_pack(members), axis_name)
    for i, x in zip(bucket, _unpack(gathered, members, lead=(n,))):
      out[i] = x
  return out


def nbytes(shape: Sequence[int], dtype) -> int:
  """Bytes of an array of this shape and dtype."""
  return math.prod(shape) * jnp.dtype(dtype).itemsize
