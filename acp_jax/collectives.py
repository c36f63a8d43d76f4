"""Collectives over a named mapped axis, packed where XLA would not.

Dense gradients are psummed leaf by leaf and left to XLA's all-reduce
combiner, which merges independent all-reduces (on CPU all of them, on GPU up
to ``--xla_gpu_all_reduce_combine_threshold_bytes``) without copies; one
flat 100 MB buffer would also all-reduce 2.7 times slower on XLA:CPU than the
same bytes in 16 pieces.

Low-rank factors are packed into one flat buffer per dtype before their
psum: that fixes the number of rounds. Left to itself, XLA:CPU combined each
leaf's Q with the next leaf's P and turned Power-SGD's two rounds into a
chain of one all-reduce per leaf. All-gathers are packed the same way, since
XLA:CPU does not combine them.
"""

from collections.abc import Callable, Sequence
import math

import jax
from jax import lax
import jax.numpy as jnp


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


def _packed(
    collective: Callable[[jax.Array], jax.Array],
    arrays: Sequence[jax.Array],
    lead: tuple[int, ...],
) -> list[jax.Array]:
  """``collective`` of one flat buffer per dtype, split back into arrays.

  ``lead`` is the shape the collective prepends (the axis size, for an
  all-gather).
  """
  by_dtype: dict[jnp.dtype, list[int]] = {}
  for i, x in enumerate(arrays):
    by_dtype.setdefault(x.dtype, []).append(i)
  out = [None] * len(arrays)
  for members in by_dtype.values():
    flat = collective(jnp.concatenate([arrays[i].ravel() for i in members]))
    start = 0
    for i in members:
      x = arrays[i]
      out[i] = flat[..., start : start + x.size].reshape(lead + x.shape)
      start += x.size
  return out


def packed_psum(arrays: Sequence[jax.Array], axis_name: str) -> list[jax.Array]:
  """``lax.psum`` of every array, one all-reduce per dtype."""
  return _packed(lambda x: lax.psum(x, axis_name), arrays, ())


def packed_all_gather(
    arrays: Sequence[jax.Array], axis_name: str
) -> list[jax.Array]:
  """``lax.all_gather`` of every array, one all-gather per dtype.

  Returns arrays with a new leading axis of the axis size: entry ``j`` holds
  device ``j``'s array.
  """
  n = axis_size(axis_name, "packed_all_gather")
  return _packed(lambda x: lax.all_gather(x, axis_name), arrays, (n,))


def nbytes(shape: Sequence[int], dtype) -> int:
  """Bytes of an array of this shape and dtype."""
  return math.prod(shape) * jnp.dtype(dtype).itemsize
