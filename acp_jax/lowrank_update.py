"""The update of the low-rank compressors (Power-SGD and ACP-SGD).

``factory_compressor`` makes the ``Compressor``; its update is ``step``: a
dense warm-up step (``dense_step``), or the factory's own exchange, a
sequence of ``psum_round``s ending in a ``Round``, expanded to the
approximate mean by ``applied``.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import _checks
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import lowrank
from acp_jax import orthogonalize
from acp_jax import phase as phase_lib
from acp_jax import projection


def check_dense_step(cfg: lowrank.LowRank, count: jax.Array) -> None:
  """Refuses a dense warm-up step that should not run: when tracing, if the
  compressor has no warm-up (the state would run dense forever); when
  running, if the state has already taken ``warmup_steps`` steps, by a host
  callback that only the dense programs carry."""
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
      error = ValueError(
          f"{cfg.caller}: at_step was not called before this step, or its"
          f" result was not used: a dense warm-up step ran after {taken}"
          f" steps, but warmup_steps={cfg.warmup_steps}: the warm-up should"
          " have ended. Call opt_state = dp.at_step(opt_state, step) (or"
          " compressor.at_step) before every step, with the number of steps"
          " taken, and use the state it returns (an nnx.Optimizer is"
          " switched in place)."
      )
      raise error

  # Every device's callback raises: one that went on would wait for the
  # others in the step's all-reduce until XLA aborts the process.
  jax.debug.callback(check, count)


def factory_compressor(
    cfg: lowrank.LowRank,
    axis_name: str,
    state_type: type,
    exchange: Callable[..., tuple["Round", Any]],
    volume: compressor.VolumeFn,
    phases: compressor.PhasesFn,
    **spec: Any,
) -> compressor.Compressor:
  """The ``Compressor`` a low-rank factory returns: state a ``state_type``
  (its fields among error, p, q, phase and count), update ``update_fn``'s,
  settings ``cfg``'s; ``spec`` adds the factory's own fields (``cycle``)."""

  def init_fn(params):
    error, p, q = lowrank.init_trees(cfg, params)
    fields = {
        "error": error,
        "p": p,
        "q": q,
        "phase": cfg.first_phase(phase_lib.Phase.P),
        "count": jnp.zeros((), jnp.int32),
    }
    return state_type(**{f: fields[f] for f in state_type._fields})

  return compressor.Compressor(
      init_fn,
      update_fn(cfg, axis_name, state_type, exchange),
      volume,
      axis_name=axis_name,
      phases=phases,
      bucket_bytes=cfg.bucket_bytes,
      leaf_order=cfg.leaf_order,
      warmup_steps=cfg.warmup_steps,
      to_phase=phase_lib.switch_to(phase_lib.Phase.P),
      made_by=(cfg.caller, lowrank.made_by(cfg, axis_name)),
      **spec,
  )


def update_fn(
    cfg: lowrank.LowRank,
    axis_name: str,
    state_type: type,
    exchange: Callable[..., tuple["Round", Any]],
) -> Callable[..., tuple[Any, Any]]:
  """A low-rank factory's update function: its checks, then ``step``."""

  def update(updates, state, params=None):
    del params
    n = _checks.begin_update(updates, axis_name, cfg.caller)
    _checks.check_state(state, state_type, cfg.caller)
    return step(cfg, axis_name, n, updates, state, exchange)

  return update


def step(
    cfg: lowrank.LowRank,
    axis_name: str,
    n: int,
    grads: Any,
    state: Any,
    exchange: Callable[..., tuple["Round", Any]],
) -> tuple[Any, Any]:
  """A low-rank compressor's update of ``grads``: a dense warm-up step or
  ``exchange(cfg, axis_name, split, state, n)``, expanded to the mean."""
  s = lowrank.split_state(cfg, grads, state)
  if phase_lib.phase_of(state.phase) is phase_lib.Phase.DENSE:
    check_dense_step(cfg, state.count)
    mean, error, q = dense_step(cfg, s, state.q, axis_name)
    return mean, state._replace(error=error, q=q, count=state.count + 1)
  sent, new_state = exchange(cfg, axis_name, s, state, n)
  return applied(sent), new_state


class Round(NamedTuple):
  """A compressing step's exchange, before its factors are expanded: for
  each compressed leaf an orthonormal basis, the same on every replica, and
  the mean of M's coordinates in it.

  On ``side`` P the coordinates are n x r on a right basis (m x r), and the
  mean is C B^T (ACP-SGD's P-step); on side Q they are r x m on a left
  basis (n x r), and it is B C (ACP-SGD's Q-step, Power-SGD's step).
  """

  split: lowrank.Split
  side: phase_lib.Phase
  bases: list[jax.Array]
  coords: list[jax.Array]
  dense: list[jax.Array]  # the mean of each leaf sent dense


def expand(side: phase_lib.Phase, basis: jax.Array, coords: jax.Array):
  """The n x m matrix that ``coords`` on ``basis`` stand for."""
  return coords @ basis.T if side is phase_lib.Phase.P else basis @ coords


def applied(r: Round) -> Any:
  """The approximate mean gradient that a round stands for, as a tree."""
  low_rank = [expand(r.side, b, c) for b, c in zip(r.bases, r.coords)]
  return lowrank.merge(r.split, low_rank, r.dense, reshape=True)


def power_step(
    means: list[jax.Array], qs: list[jax.Array]
) -> tuple[list[jax.Array], list[jax.Array]]:
  """One step of power iteration on each n x m matrix: the left basis
  P = orth(M orth(Q)) and M's coordinates P^T M (r x m) in it."""
  bases = [
      orthogonalize.orthogonalize_rows(m @ orthogonalize.orthogonalize(q))
      for m, q in zip(means, qs)
  ]
  coords = [
      collectives.row_sum(projection.project_transposed(m, b))
      for m, b in zip(means, bases)
  ]
  return bases, coords


def dense_step(
    cfg: lowrank.LowRank, s: lowrank.Split, q: Any, axis_name: str
) -> tuple[Any, Any, Any]:
  """A warm-up step: S-SGD's exchange, and the factors warmed on its result.

  Every leaf is sent whole (M = G + E, so any residual goes out too), in
  S-SGD's buckets, and the mean comes back exact. With ``warmup_factors``,
  each compressed leaf's Q then takes one step of power iteration on the
  mean: P = M orth(Q), Q = M^T orth(P). Every replica computes it from the
  same mean, so the factors stay identical without a byte more, and the
  first compressed step projects on the mean's leading subspace.

  Returns:
    ``(mean, errors, q)``: the mean tree, the (zero) residual tree, and the
    new Q factors (the state's, if not warmed).
  """
  leaves = lowrank.leaves(
      s, [m.dense() for m in s.matrices], s.dense, reshape=True
  )
  mean = collectives.bucketed_pmean(leaves, s.buckets, axis_name)
  tree = jax.tree.unflatten(s.treedef, mean)
  errors = lowrank.errors_tree(cfg, s, [jnp.zeros_like(m.grad) for m in s.matrices])
  if cfg.warmup_factors:
    means = [
        x.reshape(spec.n, spec.m) for x, spec in zip(mean, s.specs) if spec
    ]
    _, coords = power_step(means, lowrank.leaves_of(s, q))
    masked = [optax.MaskedNode()] * len(s.dense)
    q = lowrank.merge(s, [c.T for c in coords], masked, reshape=False)
  return tree, errors, q


def psum_round(
    s: lowrank.Split,
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
  None, each dense leaf, in its own leaf's bucket; ``packed`` as for
  ``collectives.bucketed_psum``. ``row_sums``: the factors are sums over
  the matrices' rows (r x m). Returns the summed factors, in their own
  dtype, and dense leaves."""
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


def as_sent(cfg: lowrank.LowRank, factor: jax.Array) -> jax.Array:
  """``factor`` rounded to ``comm_dtype`` as it will be sent, in its own
  dtype: what error feedback must subtract."""
  return factor.astype(cfg.factor_dtype(factor.dtype)).astype(factor.dtype)
