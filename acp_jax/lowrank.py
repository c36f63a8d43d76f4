"""Pieces shared by the low-rank compressors (Power-SGD and ACP-SGD)."""

from collections.abc import Callable
import math
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import _checks
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import state_trees
from acp_jax import phase as phase_lib


def check_dense_step(cfg: "LowRank", count: jax.Array) -> None:
  """Refuses a dense warm-up step that should not run: when tracing, if the
  compressor has no warm-up at all (a state saved during another one's
  warm-up would then run dense forever); when running, if the state has
  already taken ``warmup_steps`` steps (``at_step`` was not called, or its
  result not used). The run-time check is a host callback of the dense
  programs only: the compressing ones, which make up the training, carry
  none."""
  if not cfg.warmup_steps:
    raise ValueError(
        f"{cfg.caller}: the state is in the dense warm-up phase"
        " (Phase.DENSE), but this compressor has no warmup_steps, so nothing"
        " would ever end it and every step would be S-SGD's: the"
        " state was saved during a warm-up. Make the compressor with the"
        f" warmup_steps it was saved with ({cfg.caller}(..., warmup_steps=N))"
        " and call at_step before every step."
    )

  def check(taken):
    taken = int(np.asarray(taken))
    if taken >= cfg.warmup_steps:
      raise ValueError(
          f"{cfg.caller}: a dense warm-up step ran after {taken} steps, but"
          f" warmup_steps={cfg.warmup_steps}: the warm-up should have ended."
          " Call opt_state = dp.at_step(opt_state, step) (or"
          " compressor.at_step) before every step, with the number of steps"
          " taken, and use the state it returns (an nnx.Optimizer is"
          " switched in place)."
      )

  jax.debug.callback(check, count)


class MatrixSpec(NamedTuple):
  """How a leaf is compressed: viewed as an n x m matrix, sent at rank r."""

  n: int
  m: int
  rank: int


class LowRank(NamedTuple):
  """Settings of a low-rank compressor; build it with ``settings``. The
  functions of this module take it as ``cfg``."""

  rank: int
  min_compression_rate: float
  keep_dense: compressor.KeepDense
  seed: int
  caller: str  # the factory's name, for error messages
  bucket_bytes: float = collectives.DEFAULT_BUCKET_BYTES
  use_error_feedback: bool = True
  warm_start: bool = True
  comm_dtype: Any = None  # None: the factors travel in the leaves' dtype
  warmup_steps: int = 0
  warmup_factors: bool = True
  leaf_order: tuple[int, ...] | None = None  # see collectives.bucket_plan

  def plan(self, tree: Any) -> list[MatrixSpec | None]:
    """``matrix_spec`` of every leaf of ``tree``, honouring ``keep_dense``.

    Within ``collectives.row_shards`` the leaves are blocks of rows: the
    view is decided on the whole leaf, and ``n`` is the block's rows.
    """
    dense = compressor.keep_dense_leaves(self.keep_dense, tree)
    specs = []
    for x, d in zip(jax.tree.leaves(tree), dense):
      whole = collectives.global_shape(x.shape)
      spec = None if d else matrix_spec(
          whole, self.rank, self.min_compression_rate
      )
      if spec is not None:
        spec = spec._replace(n=spec.n * x.shape[0] // whole[0])
      specs.append(spec)
    return specs

  def factor_dtype(self, leaf_dtype) -> Any:
    """The dtype in which a leaf's factors are all-reduced."""
    return self.comm_dtype or leaf_dtype

  def first_phase(self, compressing: phase_lib.Phase) -> jax.Array:
    """The initial phase marker: dense if there is a warm-up."""
    return phase_lib.marker(
        phase_lib.Phase.DENSE if self.warmup_steps else compressing
    )


def settings(
    rank: Any,
    min_compression_rate: Any,
    keep_dense: compressor.KeepDense,
    seed: int,
    caller: str,
    bucket_bytes: float | None = None,
    *,
    use_error_feedback: Any = True,
    warm_start: Any = True,
    comm_dtype: Any = None,
    warmup_steps: Any = None,
    warmup_factors: Any = True,
    leaf_order: Any = None,
) -> LowRank:
  """Checks a low-rank factory's arguments."""
  return LowRank(
      keep_dense=keep_dense,
      caller=caller,
      **_checks.factory_args(
          caller,
          rank=rank,
          min_compression_rate=min_compression_rate,
          seed=seed,
          bucket_bytes=bucket_bytes,
          warmup_steps=warmup_steps,
          use_error_feedback=use_error_feedback,
          warm_start=warm_start,
          warmup_factors=warmup_factors,
          comm_dtype=comm_dtype,
          leaf_order=leaf_order,
      ),
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
  ill-conditioned inputs, on which plain Cholesky-QR gives NaN.

  The fallback is a conditional around compute only, per leaf, never around
  a collective.
  """
  first = _inverse_cholesky_factor(x.T @ x)
  q1 = x @ first
  gram = q1.T @ q1
  second = _inverse_cholesky_factor(gram)
  eye = jnp.eye(x.shape[1], dtype=x.dtype)
  ok = (
      jnp.all(jnp.isfinite(first))
      & jnp.all(jnp.isfinite(second))
      & jnp.all(jnp.abs(gram - eye) <= _CHOLESKY_MAX_DEFECT)
  )
  return jax.lax.cond(
      ok, lambda q, x: q, lambda q, x: _householder(x), q1 @ second, x
  )


def uses_cholesky_qr(n: int, r: int) -> bool:
  """Whether ``orthogonalize`` takes Cholesky-QR2 for an n x r input: for
  tall factors at large rank, where it is faster, and on the CPU backend
  only (elsewhere its fallback's conditional would cost a host round trip
  per leaf)."""
  return (
      r >= _CHOLESKY_MIN_RANK
      and n >= max(_CHOLESKY_MIN_ROWS, r)
      and jax.default_backend() == "cpu"
  )


def orthogonalize(x: jax.Array) -> jax.Array:
  """Orthonormal basis of the columns of ``x`` (n x r, n >= r).

  In float32, whatever the input dtype, so bf16 and fp16 factors stay well
  conditioned: Householder QR, or for tall factors at large rank on a CPU
  (``uses_cholesky_qr``) Cholesky-QR2 with a fallback to Householder where
  it would lose orthogonality. Either way a rank-deficient input, zero
  columns included, still gives orthonormal columns. (PyTorch's hook
  orthogonalizes by Householder QR too, ``torch.linalg.qr``, in float32 at
  rank > 2; by Gram-Schmidt at rank <= 2 and in half precision, where it
  needs its ``orthogonalization_epsilon`` against zero columns.) The result
  has the input's dtype; its columns may differ from Householder's in sign,
  which no compressor's result depends on.
  """
  x32 = x.astype(jnp.float32)
  if uses_cholesky_qr(*x.shape):
    return _cholesky_qr2(x32).astype(x.dtype)
  return _householder(x32).astype(x.dtype)


def orthogonalize_rows(x: jax.Array) -> jax.Array:
  """``orthogonalize`` for an n x r factor with a row per row of a matrix:
  within ``collectives.row_shards``, ``x`` is this device's block of rows,
  and the result is its block of the whole factor's basis (``_row_sharded_qr``).
  """
  if collectives.row_axis() is None:
    return orthogonalize(x)
  return _row_sharded_qr(x.astype(jnp.float32)).astype(x.dtype)


def _row_sharded_qr(x: jax.Array) -> jax.Array:
  """Cholesky-QR2 of a factor whose rows are sharded: each pass's Gram
  matrix, r x r, is summed over the blocks (``collectives.row_sum``), so
  every device forms the same R and takes its own rows of Q = X R^-1.

  Guarded like ``_cholesky_qr2``, where the fallback may not communicate
  (it sits in a conditional): where the check fails, the basis comes from
  the eigendecomposition of the first Gram matrix, X V diag(w)^-1/2 on the
  eigenvalues w above float32's rounding of the largest, and zero columns
  for the others. So an all-zero input gives zeros, and a rank-deficient
  one an orthonormal basis of its span padded with zero columns, which
  every compressor takes as a projection on that span; Householder's
  fallback completes the basis with arbitrary columns instead.
  """
  gram = collectives.row_sum(x.T @ x)
  first = _inverse_cholesky_factor(gram)
  q1 = x @ first
  second_gram = collectives.row_sum(q1.T @ q1)
  second = _inverse_cholesky_factor(second_gram)
  eye = jnp.eye(x.shape[1], dtype=x.dtype)
  ok = (
      jnp.all(jnp.isfinite(first))
      & jnp.all(jnp.isfinite(second))
      & jnp.all(jnp.abs(second_gram - eye) <= _CHOLESKY_MAX_DEFECT)
  )

  def by_eigenvectors(q, x, gram):
    del q
    w, v = jnp.linalg.eigh(gram)
    keep = w > jnp.finfo(w.dtype).eps * x.shape[1] * jnp.max(w)
    return x @ (v * jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, w, 1)), 0))

  return jax.lax.cond(
      ok, lambda q, x, gram: q, by_eigenvectors, q1 @ second, x, gram
  )


def project_transposed(m: jax.Array, b: jax.Array) -> jax.Array:
  """B^T M for an n x m matrix M and an n x r basis B: the transpose of the
  factor M^T B, r x m.

  It stays transposed on purpose: XLA:CPU's dot runs about 8 times slower
  when it has to lay out its result as m x r (4.5 ms against 0.57 ms for a
  4608 x 512 M at rank 4, jax 0.10.2), and the consumers take it as it is
  (an all-reduce, the product B F^T). On a CPU the small transpose B^T is
  made apart (an optimization barrier keeps XLA from folding it into the
  dot): a dot whose left operand contracts its minor dimension goes to
  XLA:CPU's fast YNNPACK path, one that contracts dimension 0 of both does
  not (30522 x 768 at rank 32: 26 ms against 41).
  """
  bt = b.T
  if jax.default_backend() == "cpu":
    bt = jax.lax.optimization_barrier(bt)
  return bt @ m


def transposed_rows(b: jax.Array) -> jax.Array:
  """B^T for an m x r ``b``, written out as an r x m row-major array, for
  ``residual``'s ``vt``.

  A plain ``b.T`` is only a layout to XLA:CPU, which reads it inside the
  residual's fusion with a stride of r between neighbouring elements of a
  row: 5 times the fusion's time (30522 x 768 at rank 32: 590 ms against
  108 with a row-major ``vt``, jax 0.10.2). A product is never fused into
  that loop, so the r x r identity times B^T (r * r * m multiply-adds, under
  a millisecond) makes XLA write it out; an optimization barrier does not,
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
  return collectives.row_sum(
      sum(project_transposed(x, b) for x in mat.terms())
  )


def residual(mat: Matrix, u: jax.Array, vt: jax.Array) -> jax.Array:
  """E' = G + E - U V^T in the leaf's shape, for n x r ``u`` and r x m
  ``vt``: one pass that reads G and E and writes E'.

  The product is spelled as its r rank-one terms so that XLA fuses it with
  the sum, instead of writing U V^T to an n x m temporary for a second pass
  to subtract (on a CPU, 0.5 times the time on 3072 x 768 at rank 32). E' is
  formed with a leading axis of one, the block shape in which
  ``DataParallel`` holds a device's residual, which lets XLA write it in
  place of E; formed in the leaf's shape and reshaped, it costs a copy of
  the whole matrix.
  """
  rank_one = [u[:, k, None] * vt[None, k, :] for k in range(u.shape[1])]
  approx = sum(rank_one[1:], rank_one[0]).reshape((1,) + mat.grad.shape)
  total = mat.grad[None]
  if mat.error is not None:
    total = total + mat.error[None]
  return (total - approx)[0]


def _warn_if_nothing_compressed(
    cfg: LowRank,
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
  dense = compressor.keep_dense_leaves(cfg.keep_dense, params)
  shapes = [
      tuple(x.shape)
      for x, d in zip(leaves, dense)
      if not d and len(x.shape) >= 2 and math.prod(x.shape)
  ]
  if shapes:
    largest = max(shapes, key=math.prod)
    warnings.warn(
        f"{cfg.caller}: no matrix leaf is compressed at rank={cfg.rank} and"
        f" min_compression_rate={cfg.min_compression_rate} (the largest,"
        f" {largest}, would not shrink by that rate), so every leaf is sent"
        " dense, as by ssgd. Lower rank or min_compression_rate to compress"
        " them.",
        # Points at the caller of the compressor's init.
        stacklevel=4,
    )


def _normal_factors(key: jax.Array, shapes: list[tuple[int, int]], dtypes):
  """Normal factors of these shapes: slices of one draw from ``key`` (one
  small program to compile, not one per shape)."""
  sizes = [math.prod(shape) for shape in shapes]
  draw = jnp.split(
      jax.random.normal(key, (sum(sizes),)), np.cumsum(sizes)[:-1]
  )
  return [
      x.reshape(shape).astype(dtype)
      for x, shape, dtype in zip(draw, shapes, dtypes)
  ]


def init_trees(cfg: LowRank, params: Any) -> tuple[Any, Any, Any]:
  """Zero residuals E, zero P factors and random Q factors, like ``params``.

  Each tree holds ``optax.MaskedNode()`` at the leaves sent dense (and the
  residuals everywhere without error feedback). The Q factors are drawn
  from ``seed``, so every replica starts from the same factors wherever
  ``init`` runs.
  """
  _checks.check_float_leaves(params, cfg.caller)
  specs = cfg.plan(params)
  leaves, treedef = jax.tree.flatten(params)
  _warn_if_nothing_compressed(cfg, leaves, specs, params)
  compressed = [(x, spec) for x, spec in zip(leaves, specs) if spec]
  draw = iter(
      _normal_factors(
          jax.random.key(cfg.seed),
          [(spec.m, spec.rank) for _, spec in compressed],
          [x.dtype for x, _ in compressed],
      )
  )
  masked = optax.MaskedNode()
  errors, ps, qs = [], [], []
  for x, spec in zip(leaves, specs):
    if spec is None:
      for tree in (errors, ps, qs):
        tree.append(masked)
      continue
    errors.append(
        jnp.zeros(x.shape, x.dtype) if cfg.use_error_feedback else masked
    )
    ps.append(jnp.zeros((spec.n, spec.rank), x.dtype))
    qs.append(next(draw))
  return tuple(jax.tree.unflatten(treedef, t) for t in (errors, ps, qs))


def start_factors(
    cfg: LowRank, s: "Split", q: Any, count: jax.Array
) -> list[jax.Array]:
  """The m x r factors a step starts its projection from: the state's ``q``
  with warm start, else new random ones for step ``count``, the same on
  every replica."""
  if cfg.warm_start:
    return leaves_of(s, q)
  key = jax.random.fold_in(jax.random.key(cfg.seed), count)
  return _normal_factors(
      key,
      [(spec.m, spec.rank) for spec in s.specs if spec],
      [m.grad.dtype for m in s.matrices],
  )


class Split(NamedTuple):
  """One update's leaves, split into compressed matrices and dense leaves."""

  treedef: Any
  shapes: list[tuple[int, ...]]
  specs: list[MatrixSpec | None]
  matrices: list[Matrix]  # M = G + E for each compressed leaf
  dense: list[jax.Array]  # the gradient of each leaf sent dense
  buckets: collectives.BucketPlan  # of all leaves, by their gradients' bytes


def split(cfg: LowRank, grads: Any, errors: Any) -> Split:
  """Checks ``grads`` against the state and pairs them with the residuals
  (without error feedback, ``errors`` is all ``MaskedNode`` and M = G)."""
  _checks.check_tree_matches(grads, errors, cfg.caller)
  leaves, treedef = jax.tree.flatten(grads)
  specs = cfg.plan(grads)
  matrices, dense = [], []
  for g, e, spec in zip(leaves, state_trees.state_leaves(errors), specs):
    if cfg.use_error_feedback and (spec is None) != state_trees.is_masked(e):
      raise ValueError(
          f"{cfg.caller}: the state was initialized to compress other leaves;"
          " init and update must use the same compressor (rank,"
          " min_compression_rate, keep_dense, use_error_feedback)."
      )
    if spec is None:
      dense.append(g)
    else:
      matrices.append(Matrix(g, None if state_trees.is_masked(e) else e, spec))
  return Split(
      treedef,
      [x.shape for x in leaves],
      specs,
      matrices,
      dense,
      collectives.leaf_plan(leaves, cfg.bucket_bytes, cfg.leaf_order),
  )


def errors_tree(cfg: LowRank, s: Split, errors: list[jax.Array]) -> Any:
  """The state's residual tree: ``errors`` (in the leaves' shapes) at the
  compressed leaves, or all ``MaskedNode`` without error feedback."""
  masked = [optax.MaskedNode()] * len(s.dense)
  if not cfg.use_error_feedback:
    errors = [optax.MaskedNode()] * len(s.matrices)
  return merge(s, errors, masked, reshape=False)


def dense_step(
    cfg: LowRank, s: Split, q: Any, axis_name: str
) -> tuple[Any, Any, Any]:
  """A warm-up step: S-SGD's exchange, and the factors warmed on its result.

  Every leaf is sent whole (M = G + E for a compressed one, so whatever
  residual the state holds goes out too), in S-SGD's buckets, and the mean
  comes back exact. With ``warmup_factors``, each compressed leaf's Q then
  takes one step of power iteration on the mean M: P = M orth(Q), Q =
  M^T orth(P). Every replica computes it from the same mean, so the factors
  stay identical without a byte more, and the first compressed step
  projects on the mean gradient's leading subspace, not on a random one.

  Returns:
    ``(mean, errors, q)``: the mean gradient tree, the residual tree (zero:
    nothing is left unsent) and the new tree of Q factors (``q``, the
    state's, if not warmed).
  """
  leaves = _leaves(
      s, [m.dense() for m in s.matrices], s.dense, reshape=True
  )
  mean = collectives.bucketed_pmean(leaves, s.buckets, axis_name)
  tree = jax.tree.unflatten(s.treedef, mean)
  errors = errors_tree(cfg, s, [jnp.zeros_like(m.grad) for m in s.matrices])
  if not cfg.warmup_factors:
    return tree, errors, q
  means = [x.reshape(spec.n, spec.m) for x, spec in zip(mean, s.specs) if spec]
  qs = [
      collectives.row_sum(
          project_transposed(m, orthogonalize_rows(m @ orthogonalize(f)))
      ).T
      for m, f in zip(means, leaves_of(s, q))
  ]
  masked = [optax.MaskedNode()] * len(s.dense)
  return tree, errors, merge(s, qs, masked, reshape=False)


def psum_round(
    s: Split,
    factors: list[jax.Array],
    dense: list[jax.Array] | None,
    axis_name: str,
    comm_dtype: Any = None,
    *,
    packed: bool = False,
    row_sums: bool = False,
) -> tuple[list[jax.Array], list[jax.Array]]:
  """One round of all-reduces, a bucket at a time: a factor of each
  compressed leaf (in ``comm_dtype``, if given) and, unless ``dense`` is
  None, each dense leaf, riding in its own leaf's bucket; ``packed`` into
  one buffer per bucket and dtype (see ``collectives.bucketed_psum``).
  ``row_sums``: the factors are sums over the matrices' rows (r x m), not
  factors with a row per row (n x r). Returns the summed factors, in their
  own dtype, and dense leaves."""
  dtypes = [f.dtype for f in factors]
  factors = iter([f.astype(comm_dtype or f.dtype) for f in factors])
  dense_in = iter(dense or ())
  per_leaf = []
  for spec in s.specs:
    if spec:
      per_leaf.append([next(factors)])
    else:
      per_leaf.append([next(dense_in)] if dense is not None else [])
  summed = collectives.bucketed_psum(
      per_leaf,
      s.buckets,
      axis_name,
      packed=packed,
      row_sums=[row_sums and spec is not None for spec in s.specs],
  )
  reduced, dense_out = [], []
  for sent, spec in zip(summed, s.specs):
    (reduced if spec else dense_out).extend(sent)
  return [f.astype(d) for f, d in zip(reduced, dtypes)], dense_out


def as_sent(cfg: LowRank, factor: jax.Array) -> jax.Array:
  """``factor`` rounded to ``comm_dtype`` as it will be sent, in its own
  dtype: what error feedback must subtract."""
  return factor.astype(cfg.factor_dtype(factor.dtype)).astype(factor.dtype)


def _leaves(
    s: Split, low_rank: list[Any], dense: list[Any], *, reshape: bool
) -> list[Any]:
  low_rank, dense = iter(low_rank), iter(dense)
  out = []
  for shape, spec in zip(s.shapes, s.specs):
    if spec is None:
      out.append(next(dense))
    else:
      x = next(low_rank)
      out.append(x.reshape(shape) if reshape else x)
  return out


def merge(
    s: Split, low_rank: list[Any], dense: list[Any], *, reshape: bool
) -> Any:
  """The tree of ``s`` with compressed leaves from ``low_rank`` (reshaped from
  n x m to the leaf's shape if ``reshape``), the others from ``dense``."""
  return jax.tree.unflatten(
      s.treedef, _leaves(s, low_rank, dense, reshape=reshape)
  )


def leaves_of(s: Split, tree: Any) -> list[jax.Array]:
  """Leaves of a state tree at the compressed positions of ``s``."""
  return [
      x
      for x, spec in zip(state_trees.state_leaves(tree), s.specs)
      if spec is not None
  ]


def check_factors(cfg: LowRank, s: Split, factors: Any, rows: str) -> None:
  """Raises unless the state's factors (``rows`` x r per compressed leaf, rows
  "n" or "m") have this compressor's rank."""
  for x, spec in zip(leaves_of(s, factors), (p for p in s.specs if p)):
    expected = (getattr(spec, rows), spec.rank)
    if tuple(x.shape) != expected:
      raise ValueError(
          f"{cfg.caller}(rank={cfg.rank}) was given a state whose factors are"
          f" {tuple(x.shape)}, not {expected}: it was made with another rank."
          " Init and update must come from the same factory call."
      )


def volume(
    cfg: LowRank, params: Any, factor_rows: Callable[[MatrixSpec], int]
) -> int:
  """Bytes of one all-reduce carrying a factor of each compressed leaf (with
  ``factor_rows(spec)`` x rank elements, in ``comm_dtype``) and every dense
  leaf."""
  specs = cfg.plan(params)
  total = 0
  for x, spec in zip(jax.tree.leaves(params), specs):
    if spec is None:
      total += collectives.nbytes(x.shape, x.dtype)
    else:
      total += collectives.nbytes(
          (factor_rows(spec), spec.rank), cfg.factor_dtype(x.dtype)
      )
  return total


def with_warmup(
    cfg: LowRank, params: Any, volumes: dict[str, compressor.CommVolume]
) -> dict[str, compressor.CommVolume]:
  """``volumes`` of the compressing phases, preceded with a warm-up by the
  dense phase's: every leaf all-reduced whole."""
  if not cfg.warmup_steps:
    return volumes
  dense = collectives.dense_nbytes(params)
  return {
      phase_lib.Phase.DENSE.value: compressor.CommVolume(all_reduce=dense),
      **volumes,
  }
