"""Pieces shared by the low-rank compressors (Power-SGD and ACP-SGD): their
settings and plan, state trees, an update's leaves split into compressed and
dense, and their bytes. Their update is ``lowrank_update``'s."""

from collections.abc import Callable
import dataclasses
import math
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import _checks
from acp_jax import buckets
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import state_trees
from acp_jax import phase as phase_lib
from acp_jax import projection


class LowRank(NamedTuple):
  """Settings of a low-rank compressor (``cfg``); build it with
  ``settings``."""

  rank: int
  min_compression_rate: float
  keep_dense: compressor.KeepDense
  seed: int
  caller: str  # the factory's name, for error messages
  bucket_bytes: float = buckets.DEFAULT_BUCKET_BYTES
  use_error_feedback: bool = True
  warm_start: bool = True
  comm_dtype: Any = None  # None: the factors travel in the leaves' dtype
  warmup_steps: int = 0
  warmup_factors: bool = True
  leaf_order: tuple[int, ...] | None = None  # see buckets.bucket_plan

  def plan(self, tree: Any) -> list[projection.MatrixSpec | None]:
    """``matrix_spec`` of every leaf of ``tree``, honouring ``keep_dense``;
    within ``collectives.row_shards``, decided on the whole leaf, with ``n``
    the block's rows."""
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


@dataclasses.dataclass(frozen=True)
class Options:
  """The settings Power-SGD and ACP-SGD share (``acp_jax.LowRankOptions``).

  Either factory takes them as ``options=`` or as keywords of the same
  names, which replace them (``acp_sgd(4, warmup_steps=100)``).

  Attributes:
    min_compression_rate: a matrix is compressed only if the factors are at
      least this many times smaller than it (PyTorch's default, 2).
    seed: seed of the initial Q, the same on every replica.
    keep_dense: a tree of bools like the params, or a function of the
      params returning one, marking leaves to send uncompressed.
    bucket_bytes: uncompressed gradient bytes per bucket (the paper's
      scaled fusion buffer); None for 25 MiB (PyTorch DDP's default),
      ``math.inf`` for one all-reduce per round and dtype.
    use_error_feedback: keep each device's residual E and add it to the
      next gradient; without it M = G and no residual is stored.
    warm_start: start each projection on Q from the last all-reduced Q;
      without it, from a fresh random Q drawn from ``seed`` and the step
      count. ACP-SGD's Q-step always projects on the P-step's P: that is
      the alternation itself.
    comm_dtype: floating dtype the factors are all-reduced in (e.g.
      ``jnp.bfloat16``), or None for the leaves' dtype. The residual takes
      the rounding too; leaves sent dense go in their own dtype.
    warmup_steps: dense S-SGD steps before compression starts (PyTorch's
      ``start_powerSGD_iter``); None (so that ``optax.inject_hyperparams``
      leaves it static) or 0 compresses from the first step.
    warmup_factors: during the warm-up, take a power-iteration step on the
      mean gradient for each Q (no extra bytes), so that compression starts
      from the gradient's leading subspace rather than a random one.
    leaf_order: the leaves in the order backprop produces their gradients,
      from ``acp_jax.backward_order(loss, params, batch)``; None for the
      reverse of the leaf order.
  """

  min_compression_rate: float = 2.0
  seed: int = 0
  keep_dense: compressor.KeepDense = None
  bucket_bytes: float | None = None
  use_error_feedback: bool = True
  warm_start: bool = True
  comm_dtype: Any = None
  warmup_steps: int | None = None
  warmup_factors: bool = True
  leaf_order: Any = None


def settings(
    caller: str,
    rank: Any,
    options: Options | None = None,
    overrides: dict[str, Any] | None = None,
) -> LowRank:
  """Checks a low-rank factory's arguments: its rank, and ``options`` with
  the keywords in ``overrides`` replacing its fields."""
  options = options or Options()
  overrides = dict(overrides or {})
  # optax.inject_hyperparams binds the factory's signature and passes its
  # **settings on as one keyword, settings={...}.
  nested = overrides.pop("settings", None)
  if isinstance(nested, dict):
    overrides.update(nested)
  if not isinstance(options, Options):
    raise TypeError(
        f"{caller}: options must be an acp_jax.LowRankOptions, got"
        f" {type(options).__name__}"
    )
  fields = [f.name for f in dataclasses.fields(Options)]
  unknown = sorted(set(overrides or ()) - set(fields))
  if unknown:
    raise TypeError(
        f"{caller}() got an unexpected keyword argument {unknown[0]!r}; its"
        f" settings are those of acp_jax.LowRankOptions: {', '.join(fields)}"
    )
  options = dataclasses.replace(options, **(overrides or {}))
  checked = {f: getattr(options, f) for f in fields if f != "keep_dense"}
  return LowRank(
      keep_dense=options.keep_dense,
      caller=caller,
      **_checks.factory_args(caller, rank=rank, **checked),
  )


def made_by(cfg: LowRank, axis_name: str) -> dict[str, Any]:
  """The factory's arguments that made ``cfg``, in the factory's order, as
  ``Compressor.made_by`` records them."""
  return {
      "rank": cfg.rank,
      "axis_name": axis_name,
      **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Options)},
  }


def matrix_spec(
    shape: tuple[int, ...], rank: int, min_compression_rate: float
) -> projection.MatrixSpec | None:
  """The matrix view of a leaf, or None if the leaf is sent dense.

  A leaf with two or more dims is an n x m matrix, m its last dim, so a
  flax conv kernel (kh, kw, in, out) becomes (kh * kw * in, out). The rank
  is clipped to min(n, m). Vectors, scalars and matrices that the factors
  would not shrink by ``min_compression_rate`` are sent dense.
  """
  if len(shape) < 2:
    return None
  n, m = math.prod(shape[:-1]), shape[-1]
  r = min(rank, n, m)
  if (n + m) * r * min_compression_rate >= n * m:
    return None
  return projection.MatrixSpec(n, m, r)


def _warn_if_nothing_compressed(
    cfg: LowRank,
    leaves: list[Any],
    specs: list[projection.MatrixSpec | None],
    params: Any,
) -> None:
  """Warns if no leaf outside ``keep_dense`` is compressed although there
  are matrices: a rank too large for all would silently make it S-SGD, but
  a small model may have nothing worth compressing."""
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
  from ``seed``, the same on every replica wherever ``init`` runs.
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
  specs: list[projection.MatrixSpec | None]
  matrices: list[projection.Matrix]  # M = G + E for each compressed leaf
  dense: list[jax.Array]  # the gradient of each leaf sent dense
  buckets: buckets.BucketPlan  # of all leaves, by their gradients' bytes


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
      error = None if state_trees.is_masked(e) else e
      matrices.append(projection.Matrix(g, error, spec))
  return Split(
      treedef,
      [x.shape for x in leaves],
      specs,
      matrices,
      dense,
      buckets.leaf_plan(leaves, cfg.bucket_bytes, cfg.leaf_order),
  )


def split_state(cfg: LowRank, grads: Any, state: Any) -> Split:
  """``split`` of ``grads`` against a low-rank state, whose factors are
  checked to have this compressor's rank."""
  s = split(cfg, grads, state.error)
  check_factors(cfg, s, state.q, "m")
  return s


def errors_tree(cfg: LowRank, s: Split, errors: list[jax.Array]) -> Any:
  """The state's residual tree: ``errors`` (in the leaves' shapes) at the
  compressed leaves, or all ``MaskedNode`` without error feedback."""
  masked = [optax.MaskedNode()] * len(s.dense)
  if not cfg.use_error_feedback:
    errors = [optax.MaskedNode()] * len(s.matrices)
  return merge(s, errors, masked, reshape=False)


def leaves(
    s: Split, low_rank: list[Any], dense: list[Any], *, reshape: bool
) -> list[Any]:
  """``merge``'s leaves, before they are a tree."""
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
      s.treedef, leaves(s, low_rank, dense, reshape=reshape)
  )


def leaves_of(s: Split, tree: Any) -> list[jax.Array]:
  """Leaves of a state tree at the compressed positions of ``s``."""
  return [
      x
      for x, spec in zip(state_trees.state_leaves(tree), s.specs)
      if spec is not None
  ]


def check_factors(cfg: LowRank, s: Split, factors: Any, rows: str) -> None:
  """Raises unless the state's factors (``rows`` "n" or "m" x r per
  compressed leaf) have this compressor's rank."""
  for x, spec in zip(leaves_of(s, factors), (p for p in s.specs if p)):
    expected = (getattr(spec, rows), spec.rank)
    if tuple(x.shape) != expected:
      raise ValueError(
          f"{cfg.caller}(rank={cfg.rank}) was given a state whose factors are"
          f" {tuple(x.shape)}, not {expected}: it was made with another rank."
          " Init and update must come from the same factory call."
      )


def volume(
    cfg: LowRank,
    params: Any,
    factor_rows: Callable[[projection.MatrixSpec], int],
) -> int:
  """Bytes of one all-reduce carrying a ``factor_rows(spec)`` x rank factor
  of each compressed leaf, in ``comm_dtype``, and every dense leaf."""
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
