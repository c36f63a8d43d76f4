"""Power-SGD: rank-r gradient compression by one step of power iteration."""

from typing import NamedTuple

import jax
import optax

from acp_jax import buckets
from acp_jax import compressor
from acp_jax import lowrank
from acp_jax import lowrank_update
from acp_jax import orthogonalize
from acp_jax import phase as phase_lib
from acp_jax import projection

Phase = phase_lib.Phase


class PowerSgdState(NamedTuple):
  """State of ``power_sgd``; ``MaskedNode`` at leaves sent dense.

  Attributes:
    error: residual E per compressed leaf, leaf shape and dtype; differs
      across devices (all ``MaskedNode`` without error feedback).
    q: warm-start factor Q per compressed leaf, (m, r), leaf dtype: the
      mean of the last step's all-reduced Q.
    phase: uint8 zeros whose shape says what the next step does: (1,)
      compress, (3, 3, 3) a dense warm-up step (see ``acp_jax.phase``).
    count: int32 scalar, the number of steps taken.
  """

  error: optax.Updates
  q: optax.Updates
  phase: jax.Array
  count: jax.Array

  @property
  def next_phase(self) -> Phase:
    """What the next step does: ``Phase.P`` (a compressing step) or
    ``Phase.DENSE`` (a warm-up step)."""
    return phase_lib.phase_of(self.phase)


def power_sgd(
    rank: int,
    *,
    axis_name: str = "data",
    options: lowrank.Options | None = None,
    **settings,
) -> compressor.Compressor:
  """Power-SGD: error-feedback low-rank compression, two all-reduces a step.

  Each compressed leaf is viewed as an n x m matrix (``lowrank.matrix_spec``);
  with G the local gradient, E the local residual and Q the warm-start factor::

    M = G + E
    P = allreduce_sum(M orth(Q));  P = orth(P)
    Q = allreduce_sum(M^T P) / N
    update = P Q^T;  E = M - update

  Each bucket packs its P factors, with its leaves sent dense, into one
  all-reduce, then its Q factors into a second one, which needs the first
  one's result: the two can neither be fused nor overlapped with backprop.
  On a CPU backend all leaves share one bucket
  (``buckets.for_packed_rounds``). A warm-up (``warmup_steps``) runs
  S-SGD's steps first.

  Args:
    rank: rank r of the factors, clipped per leaf to min(n, m).
    axis_name: the mapped axis over which devices hold their data shards.
    options: the settings Power-SGD and ACP-SGD share, an
      ``acp_jax.LowRankOptions``; None for their defaults.
    **settings: any of its fields by name, replacing ``options``'.

  Returns:
    A ``Compressor`` whose update, under ``shard_map`` or ``pmap`` over
    ``axis_name``, returns the approximate mean of the devices' gradients.

  Example::

    tx = acp_jax.chain(acp_jax.power_sgd(rank=4), optax.sgd(0.1))

  .. warning::
    Put it first in the chain (``acp_jax.chain`` does): it must see each
    device's own gradients. With ``warmup_steps``, call ``at_step`` before
    every step.

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019. https://arxiv.org/abs/1905.13727
  """
  cfg = lowrank.settings("power_sgd", rank, options, settings)

  def volume(params, num_devices):
    del num_devices
    step = lowrank.volume(cfg, params, lambda spec: spec.n + spec.m)
    return lowrank.with_warmup(
        cfg, params, {phase_lib.STEP: compressor.CommVolume(all_reduce=step)}
    )

  def phases(state):
    if not cfg.warmup_steps:
      return {phase_lib.STEP: state}
    return phase_lib.abstract_states(
        state, {Phase.DENSE.value: Phase.DENSE, phase_lib.STEP: Phase.P}
    )

  return lowrank_update.factory_compressor(
      cfg,
      axis_name,
      PowerSgdState,
      exchange,
      volume,
      phases,
      packed_rounds=True,
  )


def exchange(
    cfg: lowrank.LowRank,
    axis_name: str,
    s: lowrank.Split,
    state: PowerSgdState,
    n: int,
) -> tuple[lowrank_update.Round, PowerSgdState]:
  """A compressing step of ``s``'s matrices: its two rounds of all-reduces,
  and the state after them. The basis is orth(P), P the sum of M orth(Q);
  the coordinates are Q^T = orth(P)^T M (r x m) averaged; the residual is
  E' = M - orth(P) Q^T, with the mean Q (all of it was applied)."""
  s = s._replace(buckets=buckets.for_packed_rounds(s.buckets))
  previous = lowrank.start_factors(cfg, s, state.q, state.count)
  # The warm-start Q, a mean of M^T P, carries the gradient's scale, so
  # M Q carries its square: in float16 that overflows on a 512 x 512 leaf
  # with entries near 3. Only Q's span matters, so an orthonormal basis of
  # it keeps M Q at M's scale, as PyTorch's powerSGD_hook does.
  qs = [orthogonalize.orthogonalize(q) for q in previous]
  ps, dense = lowrank_update.psum_round(
      s,
      [projection.project(m, q) for m, q in zip(s.matrices, qs)],
      s.dense,
      axis_name,
      cfg.comm_dtype,
      packed=True,
  )
  ps = [orthogonalize.orthogonalize_rows(p) for p in ps]
  # Q needs the reduced P: a second round that can neither fuse with the
  # first nor start before it ends.
  qts, _ = lowrank_update.psum_round(
      s,
      [
          projection.project_terms_transposed(m, p)
          for m, p in zip(s.matrices, ps)
      ],
      None,
      axis_name,
      cfg.comm_dtype,
      packed=True,
      row_sums=True,
  )
  qts = [qt / n for qt in qts]
  errors = [
      projection.residual(m, p, qt, product=p @ qt)
      for m, p, qt in zip(s.matrices, ps, qts)
  ]
  masked = [optax.MaskedNode()] * len(s.dense)
  new_state = PowerSgdState(
      error=lowrank.errors_tree(cfg, s, errors),
      q=lowrank.merge(s, [qt.T for qt in qts], masked, reshape=False),
      phase=state.phase,
      count=state.count + 1,
  )
  sent = lowrank_update.Round(s, Phase.Q, ps, qts, [x / n for x in dense])
  return sent, new_state
