"""Pieces shared by the low-rank compressors (Power-SGD and ACP-SGD)."""

from collections.abc import Callable
import math
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import compressor
from acp_jax import collectives


class MatrixSpec(NamedTuple):
  """How a leaf is compressed: viewed as an n x m matrix, sent at rank r."""

  n: int
  m: int
  rank: int


class LowRank(NamedTuple):
  """Settings of a low-rank compressor; build it with ``settings``."""

  rank: int
  min_compression_rate: float
  keep_dense: compressor.KeepDense
  seed: int
  caller: str  # the factory's name, for error messages
  bucket_bytes: float = collectives.DEFAULT_BUCKET_BYTES

  def plan(self, tree: Any) -> list[MatrixSpec | None]:
    """``matrix_spec`` of every leaf of ``tree``, honouring ``keep_dense``."""
    dense = compressor.keep_dense_leaves(self.keep_dense, tree)
    return [
        None
        if d
        else matrix_spec(tuple(x.shape), self.rank, self.min_compression_rate)
        for x, d in zip(jax.tree.leaves(tree), dense)
    ]


def settings(
    rank: Any,
    min_compression_rate: Any,
    keep_dense: compressor.KeepDense,
    seed: int,
    caller: str,
    bucket_bytes: float | None = None,
) -> LowRank:
  """Checks a low-rank factory's arguments."""
  compressor.check_static(
      caller,
      rank=rank,
      min_compression_rate=min_compression_rate,
      seed=seed,
      bucket_bytes=bucket_bytes,
  )
  if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
    raise ValueError(f"rank must be a positive int, got {rank!r}")
  if (
      isinstance(min_compression_rate, bool)
      or not isinstance(min_compression_rate, (int, float))
      or not min_compression_rate >= 0
  ):
    raise ValueError(
        "min_compression_rate must be a non-negative number, got"
        f" {min_compression_rate!r}"
    )
  bucket_bytes = collectives.check_bucket_bytes(bucket_bytes, caller)
  return LowRank(
      rank, min_compression_rate, keep_dense, seed, caller, bucket_bytes
  )


def matrix_spec(
    shape: tuple[int, ...], rank: int, min_compression_rate: float
) -> MatrixSpec | None:
  """The matrix view of a leaf, or None if the leaf is sent dense.

  A leaf with two or more dims is an n x m matrix, m its last dim and n the
  product of the others, so a flax conv kernel (kh, kw, in, out) becomes
  (kh * kw * in, out). The rank is clipped to min(n, m). Vectors, scalars and
  matrices that the factors would not shrink by ``min_compression_rate`` are
  sent dense.
  """
  if len(shape) < 2:
    return None
  n, m = math.prod(shape[:-1]), shape[-1]
  r = min(rank, n, m)
  if (n + m) * r * min_compression_rate >= n * m:
    return None
  return MatrixSpec(n, m, r)


def orthogonalize(x: jax.Array) -> jax.Array:
  """Orthonormal basis of the columns of ``x`` (n x r, n >= r).

  Householder QR in float32, whatever the input dtype, so bf16 and fp16
  factors stay well conditioned; a rank-deficient input still gives
  orthonormal columns. The result has the input's dtype.
  """
  q, _ = jnp.linalg.qr(x.astype(jnp.float32))
  return q.astype(x.dtype)


def project_transposed(m: jax.Array, b: jax.Array) -> jax.Array:
  """B^T M for an n x m matrix M and an n x r basis B: the transpose of the
  factor M^T B, r x m.

  It stays transposed on purpose: XLA:CPU's dot runs about 8 times slower
  when it has to lay out its result as m x r (4.5 ms against 0.57 ms for a
  4608 x 512 M at rank 4, jax 0.10.2), and the consumers take it as it is
  (a packed all-reduce, the product B F^T).
  """
  return b.T @ m


def _warn_if_nothing_compressed(
    lr: LowRank,
    leaves: list[Any],
    specs: list[MatrixSpec | None],
    params: Any,
) -> None:
  """Warns if no leaf is compressed although there are matrices.

  Matrices in ``keep_dense`` do not count. A rank too large for every matrix
  would otherwise turn the compressor into S-SGD silently; it only warns, as
  a small model may have nothing worth compressing.
  """
  if any(spec is not None for spec in specs):
    return
  dense = compressor.keep_dense_leaves(lr.keep_dense, params)
  shapes = [
      tuple(x.shape)
      for x, d in zip(leaves, dense)
      if not d and len(x.shape) >= 2 and math.prod(x.shape)
  ]
  if shapes:
    largest = max(shapes, key=math.prod)
    warnings.warn(
        f"{lr.caller}: no matrix leaf is compressed at rank={lr.rank} and"
        f" min_compression_rate={lr.min_compression_rate} (the largest,"
        f" {largest}, would not shrink by that rate), so every leaf is sent"
        " dense, as by ssgd. Lower rank or min_compression_rate to compress"
        " them.",
        # Points at the caller of the compressor's init.
        stacklevel=4,
    )


def init_trees(lr: LowRank, params: Any) -> tuple[Any, Any, Any]:
  """Zero residuals E, zero P factors and random Q factors, like ``params``.

  Each tree holds ``optax.MaskedNode()`` at the leaves sent dense. The Q
  factors are slices of one normal draw from ``seed`` (one small program to
  compile, not one per shape), so every replica starts from the same factors
  wherever ``init`` runs.
  """
  compressor.check_float_leaves(params, lr.caller)
  specs = lr.plan(params)
  leaves, treedef = jax.tree.flatten(params)
  _warn_if_nothing_compressed(lr, leaves, specs, params)
  sizes = [spec.m * spec.rank for spec in specs if spec is not None]
  draw = iter(
      jnp.split(
          jax.random.normal(jax.random.key(lr.seed), (sum(sizes),)),
          np.cumsum(sizes)[:-1],
      )
  )
  errors, ps, qs = [], [], []
  for x, spec in zip(leaves, specs):
    if spec is None:
      for tree in (errors, ps, qs):
        tree.append(optax.MaskedNode())
      continue
    errors.append(jnp.zeros(x.shape, x.dtype))
    ps.append(jnp.zeros((spec.n, spec.rank), x.dtype))
    qs.append(next(draw).reshape(spec.m, spec.rank).astype(x.dtype))
  return tuple(jax.tree.unflatten(treedef, t) for t in (errors, ps, qs))


class Split(NamedTuple):
  """One update's leaves, split into compressed matrices and dense leaves."""

  treedef: Any
  shapes: list[tuple[int, ...]]
  specs: list[MatrixSpec | None]
  matrices: list[jax.Array]  # M = G + E, n x m, for each compressed leaf
  dense: list[jax.Array]  # the gradient of each leaf sent dense
  buckets: collectives.BucketPlan  # of all leaves, by their gradients' bytes


def split(lr: LowRank, grads: Any, errors: Any) -> Split:
  """Checks ``grads`` against the state and adds the residuals to them."""
  compressor.check_tree_matches(grads, errors, lr.caller)
  leaves, treedef = jax.tree.flatten(grads)
  specs = lr.plan(grads)
  matrices, dense = [], []
  for g, e, spec in zip(leaves, compressor.state_leaves(errors), specs):
    if (spec is None) != compressor.is_masked(e):
      raise ValueError(
          f"{lr.caller}: the state was initialized to compress other leaves;"
          " init and update must use the same compressor (rank,"
          " min_compression_rate, keep_dense)."
      )
    if spec is None:
      dense.append(g)
    else:
      matrices.append((g + e).reshape(spec.n, spec.m))
  return Split(
      treedef,
      [x.shape for x in leaves],
      specs,
      matrices,
      dense,
      collectives.leaf_plan(leaves, lr.bucket_bytes),
  )


def psum_round(
    s: Split,
    factors: list[jax.Array],
    dense: list[jax.Array] | None,
    axis_name: str,
) -> tuple[list[jax.Array], list[jax.Array]]:
  """One round of all-reduces, a bucket at a time: a factor of each
  compressed leaf and, unless ``dense`` is None, each dense leaf, riding in
  its own leaf's bucket. Returns the summed factors and dense leaves."""
  factors, dense_in = iter(factors), iter(dense or ())
  per_leaf = []
  for spec in s.specs:
    if spec:
      per_leaf.append([next(factors)])
    else:
      per_leaf.append([next(dense_in)] if dense is not None else [])
  summed = collectives.bucketed_psum(per_leaf, s.buckets, axis_name)
  reduced, dense_out = [], []
  for sent, spec in zip(summed, s.specs):
    (reduced if spec else dense_out).extend(sent)
  return reduced, dense_out


def merge(
    s: Split, low_rank: list[Any], dense: list[Any], *, reshape: bool
) -> Any:
  """The tree of ``s`` with compressed leaves from ``low_rank`` (reshaped from
  n x m to the leaf's shape if ``reshape``), the others from ``dense``."""
  low_rank, dense = iter(low_rank), iter(dense)
  out = []
  for shape, spec in zip(s.shapes, s.specs):
    if spec is None:
      out.append(next(dense))
    else:
      x = next(low_rank)
      out.append(x.reshape(shape) if reshape else x)
  return jax.tree.unflatten(s.treedef, out)


def leaves_of(s: Split, tree: Any) -> list[jax.Array]:
  """Leaves of a state tree at the compressed positions of ``s``."""
  return [
      x
      for x, spec in zip(compressor.state_leaves(tree), s.specs)
      if spec is not None
  ]


def check_factors(lr: LowRank, s: Split, factors: Any, rows: str) -> None:
  """Raises unless the state's factors (``rows`` x r per compressed leaf, rows
  "n" or "m") have this compressor's rank."""
  for x, spec in zip(leaves_of(s, factors), (p for p in s.specs if p)):
    expected = (getattr(spec, rows), spec.rank)
    if tuple(x.shape) != expected:
      raise ValueError(
          f"{lr.caller}(rank={lr.rank}) was given a state whose factors are"
          f" {tuple(x.shape)}, not {expected}: it was made with another rank."
          " Init and update must come from the same factory call."
      )


def volume(
    lr: LowRank, params: Any, factor_rows: Callable[[MatrixSpec], int]
) -> int:
  """Bytes of one all-reduce carrying a factor of each compressed leaf (with
  ``factor_rows(spec)`` x rank elements) and every dense leaf."""
  specs = lr.plan(params)
  total = 0
  for x, spec in zip(jax.tree.leaves(params), specs):
    shape = x.shape if spec is None else (factor_rows(spec), spec.rank)
    total += collectives.nbytes(shape, x.dtype)
  return total
