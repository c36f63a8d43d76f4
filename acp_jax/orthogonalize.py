"""Orthonormal bases of the low-rank factors: Householder QR, Cholesky-QR2
where it is faster, and its row-sharded form."""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from acp_jax import collectives

# Cholesky-QR2 beats Householder QR from this rank and height on XLA:CPU
# (single-threaded LAPACK, minimum of 30 interleaved runs: 30522 x 32 in 7.3 ms
# against 15.1, 3072 x 32 in 0.56 against 2.3, 768 x 32 in 0.16 against 0.19;
# at rank 4 and 8 it is 1.4 to 3.4 times slower, at 256 x 32 1.2 times).
_CHOLESKY_MIN_RANK = 32
_CHOLESKY_MIN_ROWS = 768
# Largest max|Q1^T Q1 - I| after the first pass that the second one corrects
# to float32 accuracy; beyond it the input is too ill-conditioned.
_CHOLESKY_MAX_DEFECT = 0.1


def _householder(x: jax.Array) -> jax.Array:
  return jnp.linalg.qr(x)[0]


def _inverse_cholesky_factor(gram: jax.Array) -> jax.Array:
  """R^-1 for the Cholesky factor R = L^T of ``gram`` = R^T R (r x r); NaN
  where ``gram`` is not positive definite."""
  lower = jnp.linalg.cholesky(gram)
  eye = jnp.eye(gram.shape[0], dtype=gram.dtype)
  return jax.scipy.linalg.solve_triangular(lower, eye, lower=True).T


def _cholesky_qr2(x: jax.Array) -> jax.Array:
  """Q of ``x`` by two passes of Cholesky-QR, guarded: Householder's Q where
  the r x r check fails (R^-1 not finite, or the first pass's Q too far from
  orthonormal for the second to correct), as on zero, rank-deficient or
  ill-conditioned inputs, on which plain Cholesky-QR gives NaN. The
  fallback's conditional is around compute only, never a collective."""
  q, ok, _ = _checked_two_passes(x, lambda a: a.T @ a)
  return jax.lax.cond(ok, lambda q, x: q, lambda q, x: _householder(x), q, x)


def _checked_two_passes(
    x: jax.Array, gram_of: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Cholesky-QR2 of ``x``, each Gram matrix formed by ``gram_of``: its Q,
  whether the check passes, and the first Gram matrix."""
  gram = gram_of(x)
  first = _inverse_cholesky_factor(gram)
  q1 = x @ first
  second_gram = gram_of(q1)
  second = _inverse_cholesky_factor(second_gram)
  eye = jnp.eye(x.shape[1], dtype=x.dtype)
  ok = (
      jnp.all(jnp.isfinite(first))
      & jnp.all(jnp.isfinite(second))
      & jnp.all(jnp.abs(second_gram - eye) <= _CHOLESKY_MAX_DEFECT)
  )
  return q1 @ second, ok, gram


def uses_cholesky_qr(n: int, r: int) -> bool:
  """Whether ``orthogonalize`` takes Cholesky-QR2 for an n x r input: for
  tall factors at large rank, on the CPU backend only (elsewhere its
  fallback's conditional would cost a host round trip per leaf)."""
  return (
      r >= _CHOLESKY_MIN_RANK
      and n >= max(_CHOLESKY_MIN_ROWS, r)
      and jax.default_backend() == "cpu"
  )


def orthogonalize(x: jax.Array) -> jax.Array:
  """Orthonormal basis of the columns of ``x`` (n x r, n >= r).

  In float32, whatever the input dtype, so bf16 and fp16 factors stay well
  conditioned: Householder QR, or (``uses_cholesky_qr``) Cholesky-QR2 with
  a fallback to Householder where it would lose orthogonality. Either way a
  rank-deficient input, zero columns included, gives orthonormal columns
  (PyTorch's Gram-Schmidt at rank <= 2 needs an epsilon for that). The
  result has the input's dtype; its columns may differ from Householder's
  in sign, which no compressor's result depends on.
  """
  x32 = x.astype(jnp.float32)
  if uses_cholesky_qr(*x.shape):
    return _cholesky_qr2(x32).astype(x.dtype)
  return _householder(x32).astype(x.dtype)


def orthogonalize_rows(x: jax.Array) -> jax.Array:
  """``orthogonalize`` for an n x r factor with a row per row of a matrix:
  within ``collectives.row_shards``, of this device's block of rows, giving
  its block of the whole factor's basis."""
  if collectives.row_axis() is None:
    return orthogonalize(x)
  return _row_sharded_qr(x.astype(jnp.float32)).astype(x.dtype)


def _row_sharded_qr(x: jax.Array) -> jax.Array:
  """Cholesky-QR2 of a factor whose rows are sharded: each pass's Gram
  matrix, r x r, is summed over the blocks (``collectives.row_sum``), so
  every device forms the same R and takes its own rows of Q = X R^-1.

  Guarded like ``_cholesky_qr2``, but the fallback, in a conditional, may
  not communicate: the basis comes from the eigendecomposition of the first
  Gram matrix, X V diag(w)^-1/2 on the eigenvalues w above float32's
  rounding of the largest, and zero columns for the others. So an all-zero
  input gives zeros, a rank-deficient one an orthonormal basis of its span
  padded with zero columns: to every compressor, a projection on that span.
  """
  q, ok, gram = _checked_two_passes(x, lambda a: collectives.row_sum(a.T @ a))

  def by_eigenvectors(q, x, gram):
    del q
    w, v = jnp.linalg.eigh(gram)
    keep = w > jnp.finfo(w.dtype).eps * x.shape[1] * jnp.max(w)
    return x @ (v * jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, w, 1)), 0))

  return jax.lax.cond(ok, lambda q, x, gram: q, by_eigenvectors, q, x, gram)
