"""A compressed leaf's matrix M = G + E and the products on it, each written
to make as few passes over the n x m matrix as XLA allows: on a CPU the
low-rank updates are bound by those passes, not by their arithmetic."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from acp_jax import collectives


class MatrixSpec(NamedTuple):
  """How a leaf is compressed: viewed as an n x m matrix, sent at rank r."""

  n: int
  m: int
  rank: int


def project_transposed(m: jax.Array, b: jax.Array) -> jax.Array:
  """B^T M for an n x m matrix M and an n x r basis B: the transpose of the
  factor M^T B, r x m.

  It stays transposed on purpose: XLA:CPU's dot runs about 8 times slower
  when it lays out its result as m x r (4.5 ms against 0.57 ms for a
  4608 x 512 M at rank 4, jax 0.10.2), and the consumers take it as it is.
  On a CPU the small B^T is made apart (an optimization barrier keeps XLA
  from folding it into the dot): a dot whose left operand contracts its
  minor dimension goes to XLA:CPU's fast YNNPACK path, one that contracts
  dimension 0 of both does not (30522 x 768 at rank 32: 26 ms against 41).
  """
  bt = b.T
  if jax.default_backend() == "cpu":
    bt = jax.lax.optimization_barrier(bt)
  return bt @ m


def transposed_rows(b: jax.Array) -> jax.Array:
  """B^T for an m x r ``b``, written out as an r x m row-major array.

  A plain ``b.T`` is only a layout to XLA:CPU, which reads it inside the
  residual's fusion with a stride of r: 5 times the fusion's time
  (30522 x 768 at rank 32: 590 ms against 108, jax 0.10.2). A product is
  never fused into that loop, so the r x r identity times B^T (under a
  millisecond) makes XLA write it out; an optimization barrier does not,
  as XLA:CPU removes it before choosing layouts.
  """
  if jax.default_backend() != "cpu":
    return b.T
  return jnp.eye(b.shape[1], dtype=b.dtype) @ b.T


class Matrix(NamedTuple):
  """A compressed leaf's M = G + E, kept as its two terms: forming M would
  write a whole n x m temporary, and each pass over the matrix costs as much
  as the arithmetic of a low-rank step on it."""

  grad: jax.Array  # G, the leaf's gradient, leaf shape
  error: jax.Array | None  # E, its residual, leaf shape; None: M = G
  spec: MatrixSpec

  def terms(self) -> list[jax.Array]:
    """G and E as n x m matrices (views: a reshape of a row-major array)."""
    shape = (self.spec.n, self.spec.m)
    terms = [self.grad] if self.error is None else [self.grad, self.error]
    return [x.reshape(shape) for x in terms]

  def dense(self) -> jax.Array:
    """M itself, n x m."""
    return sum(self.terms()[1:], self.terms()[0])


def project(mat: Matrix, b: jax.Array) -> jax.Array:
  """M B for an m x r ``b``, n x r: each term projected apart, which reads
  G and E once each and writes nothing of their size."""
  return sum(x @ b for x in mat.terms())


def project_terms_transposed(mat: Matrix, b: jax.Array) -> jax.Array:
  """B^T M for an n x r ``b``, r x m (``project_transposed`` of each term),
  summed over the row blocks within ``collectives.row_shards``."""
  return collectives.row_sum(sum(project_transposed(x, b) for x in mat.terms()))


# From this rank, a residual whose product U V^T is written anyway (Power-SGD's
# update) reads it back rather than recomputing its r rank-one terms. On
# XLA:CPU, residual and product alone (minimum of 25 runs): 3072 x 768 in
# 2.1 ms against 4.6 at rank 32 and 1.3 against 1.9 at rank 16; at ranks 8
# and 4, 0.88 to 1.2 times, 30522 x 768 10 % slower at rank 4. BERT-Base's
# Power-SGD step at rank 32: 644 ms against 763 (medians of 9, interleaved).
# ACP-SGD's residual takes the local factor, so it has no such product;
# writing one for it gained under 6 %, within the noise.
_REUSE_PRODUCT_MIN_RANK = 16


def residual(
    mat: Matrix,
    u: jax.Array,
    vt: jax.Array,
    product: jax.Array | None = None,
) -> jax.Array:
  """E' = G + E - U V^T in the leaf's shape, for n x r ``u`` and r x m
  ``vt``: one pass that reads G and E and writes E'.

  The product is spelled as its r rank-one terms so that XLA fuses it with
  the sum instead of writing U V^T to an n x m temporary. Where the step
  writes U V^T anyway, pass it as ``product`` (n x m): from rank
  ``_REUSE_PRODUCT_MIN_RANK`` the pass reads it instead. E' is formed with
  a leading axis of one, the block shape in which ``DataParallel`` holds a
  device's residual, which lets XLA write it in place of E; formed in the
  leaf's shape and reshaped, it costs a copy of the whole matrix.
  """
  if product is not None and u.shape[1] >= _REUSE_PRODUCT_MIN_RANK:
    approx = product
  else:
    rank_one = [u[:, k, None] * vt[None, k, :] for k in range(u.shape[1])]
    approx = sum(rank_one[1:], rank_one[0])
  approx = approx.reshape((1,) + mat.grad.shape)
  total = mat.grad[None]
  if mat.error is not None:
    total = total + mat.error[None]
  return (total - approx)[0]
