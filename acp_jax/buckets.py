"""Bucket plans: which gradient leaves travel together, in which order (see
``acp_jax.collectives`` for how a bucket is sent)."""

from collections.abc import Sequence
from typing import Any

import jax

from acp_jax import collectives

# PyTorch DDP's default bucket_cap_mb.
DEFAULT_BUCKET_BYTES = 25 * 2**20

# Leaf indices, bucket by bucket, in the order the buckets are sent.
BucketPlan = tuple[tuple[int, ...], ...]


def bucket_plan(
    leaf_bytes: Sequence[int],
    bucket_bytes: float,
    leaf_order: Sequence[int] | None = None,
) -> BucketPlan:
  """Leaves grouped into buckets, in backward order.

  Args:
    leaf_bytes: the uncompressed bytes of each leaf, in leaf order.
    bucket_bytes: a bucket is closed when the next leaf would take it past
      this many bytes; a larger leaf fills a bucket alone. Empty leaves join
      the current bucket, so they never change the plan of the others.
    leaf_order: the leaves' indices in backward order (``backward_order``),
      each once; None for the reverse of the leaf order.

  Returns:
    Tuples of leaf indices, in ``leaf_order``.
  """
  order = range(len(leaf_bytes) - 1, -1, -1)
  if leaf_order is not None:
    if sorted(leaf_order) != list(range(len(leaf_bytes))):
      raise ValueError(
          f"leaf_order {tuple(leaf_order)} does not order the"
          f" {len(leaf_bytes)} leaves 0..{len(leaf_bytes) - 1}: it was read"
          " from another model's loss, or the params tree changed. Read it"
          " again with backward_order(loss, params, ...)."
      )
    order = leaf_order
  buckets, current, size = [], [], 0
  for i in order:
    if current and leaf_bytes[i] and size + leaf_bytes[i] > bucket_bytes:
      buckets.append(tuple(current))
      current, size = [], 0
    current.append(i)
    size += leaf_bytes[i]
  if current:
    buckets.append(tuple(current))
  return tuple(buckets)


def leaf_plan(
    leaves: Sequence,
    bucket_bytes: float,
    leaf_order: Sequence[int] | None = None,
) -> BucketPlan:
  """``bucket_plan`` of arrays (or their shapes), by their own bytes."""
  return bucket_plan(
      [collectives.nbytes(x.shape, x.dtype) for x in leaves],
      bucket_bytes,
      leaf_order,
  )


def _produced_at(jaxpr, var) -> tuple[int, ...] | None:
  """Where in ``jaxpr`` ``var`` is made: its equation's index, then its
  place inside a call's own jaxpr; None for an input or a literal."""
  for index, eqn in enumerate(jaxpr.eqns):
    if any(out is var for out in eqn.outvars):
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      inner = getattr(inner, "jaxpr", inner)
      if inner is not None and len(inner.outvars) == len(eqn.outvars):
        position = [o is var for o in eqn.outvars].index(True)
        below = _produced_at(inner, inner.outvars[position])
        return (index,) + (below or ())
      return (index,)
  return None


def backward_order(loss, params: Any, *args, **kwargs) -> tuple[int, ...]:
  """The leaves of ``params`` in the order ``jax.grad`` computes their
  gradients: a ``leaf_order`` for the compressors' buckets.

  It reads the order of the gradient equations in
  ``jax.make_jaxpr(jax.grad(loss))(params, *args, **kwargs)``, which
  follows backprop (the compiled step completes them in nearly the same
  order): a tied embedding, used first and last, gets its gradient last. A
  gradient that jax returns as a literal waits for nothing and comes first.

  Args:
    loss: a function of ``params`` (its first argument) and the other
      arguments, returning a scalar.
    params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` like them.
    *args: the other arguments (a batch, or its shapes).
    **kwargs: keyword arguments of ``loss``.

  Returns:
    Indices into ``jax.tree.leaves(params)``, the first gradient first.
  """
  closed = jax.make_jaxpr(jax.grad(loss))(params, *args, **kwargs)
  jaxpr = closed.jaxpr
  places = [_produced_at(jaxpr, var) for var in jaxpr.outvars]
  return tuple(
      sorted(range(len(places)), key=lambda i: (places[i] or (-1,), -i))
  )


def for_packed_rounds(plan: BucketPlan) -> BucketPlan:
  """The buckets of a method that packs each round into buffers: ``plan``
  itself, or all in one bucket on the CPU backend, where a bucket buys no
  overlap and costs a message, and where the all-reduce combiner would
  chain the buckets' rounds of a method whose second round needs the
  first's result (see ``acp_jax.collectives``)."""
  if jax.default_backend() != "cpu" or len(plan) < 2:
    return plan
  return (tuple(i for bucket in plan for i in bucket),)
