"""ACP-SGD: Power-SGD's two halves, alternated across steps."""

from typing import NamedTuple

import jax
import optax

from acp_jax import buckets
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import lowrank
from acp_jax import lowrank_update
from acp_jax import orthogonalize
from acp_jax import phase as phase_lib
from acp_jax import projection

Phase = phase_lib.Phase


class AcpSgdState(NamedTuple):
  """State of ``acp_sgd``; ``MaskedNode`` at leaves sent dense.

  Attributes:
    error: residual E per compressed leaf, leaf shape and dtype; differs
      across devices (all ``MaskedNode`` without error feedback).
    p: (n, r) mean of the last P-step's all-reduced P, leaf dtype.
    q: (m, r) mean of the last Q-step's all-reduced Q, leaf dtype (random
      from the seed before the first Q-step).
    phase: uint8 zeros whose shape says what the next step does: (1,) a
      P-step, (2, 2) a Q-step, (3, 3, 3) a dense warm-up step.
    count: int32 scalar, the number of steps taken.
  """

  error: optax.Updates
  p: optax.Updates
  q: optax.Updates
  phase: jax.Array
  count: jax.Array

  @property
  def next_phase(self) -> Phase:
    """What the next step does: ``Phase.P``, ``Phase.Q`` (compressing
    steps, in turn) or ``Phase.DENSE`` (a warm-up step)."""
    return phase_lib.phase_of(self.phase)


# The phases of the compressing steps, in the order they alternate.
_CYCLE = (Phase.P, Phase.Q)


def acp_sgd(
    rank: int,
    *,
    axis_name: str = "data",
    options: lowrank.Options | None = None,
    **settings,
) -> compressor.Compressor:
  """ACP-SGD: alternate compressed Power-SGD, one all-reduce a step.

  Each compressed leaf is viewed as an n x m matrix (``lowrank.matrix_spec``),
  M = G + E its local gradient plus residual. Steps alternate::

    P-step:  Q' = orth(Q);  P = M Q';  E = M - P Q'^T
             P = allreduce_sum(P) / N;  update = P Q'^T
    Q-step:  P' = orth(P);  Q = M^T P';  E = M - P' Q^T
             Q = allreduce_sum(Q) / N;  update = P' Q^T

  The factor each step projects onto comes from the previous step, so
  nothing in a step waits on its own communication: its one round of
  all-reduces (factors plus the leaves sent dense) can fuse and overlap like
  S-SGD's, in S-SGD's buckets, at about half Power-SGD's volume. The phase
  lives in the shape of the state's ``phase`` array: a jitted step compiles
  once per phase. A warm-up (``warmup_steps``) runs S-SGD's steps first.

  Args:
    rank: rank r of the factors, clipped per leaf to min(n, m).
    axis_name: the mapped axis over which devices hold their data shards.
    options: the settings it shares with ``power_sgd``, an
      ``acp_jax.LowRankOptions``; None for their defaults.
    **settings: any of its fields by name, replacing ``options``'.

  Returns:
    A ``Compressor`` whose update, under ``shard_map`` or ``pmap`` over
    ``axis_name``, returns the approximate mean of the devices' gradients.

  Example::

    tx = acp_jax.chain(acp_jax.acp_sgd(rank=4), optax.sgd(0.1, momentum=0.9))

  .. warning::
    Put it first in the chain (``acp_jax.chain`` does): it must see each
    device's own gradients, or use ``acp_jax.DataParallel``. The shape of
    the state's ``phase`` array alternates, so a ``lax.scan`` over steps
    must take two steps per iteration. With ``warmup_steps``, call
    ``at_step`` before every step.

  References:
    Zhang et al., "Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning", ICDCS 2023. https://arxiv.org/abs/2306.08881
  """
  cfg = lowrank.settings("acp_sgd", rank, options, settings)

  def volume(params, num_devices):
    del num_devices
    phase_volume = lambda rows: compressor.CommVolume(
        all_reduce=lowrank.volume(cfg, params, rows)
    )
    return lowrank.with_warmup(
        cfg,
        params,
        {
            Phase.P.value: phase_volume(lambda spec: spec.n),
            Phase.Q.value: phase_volume(lambda spec: spec.m),
        },
    )

  def phases(state):
    names = (Phase.DENSE, *_CYCLE) if cfg.warmup_steps else _CYCLE
    return phase_lib.abstract_states(state, {p.value: p for p in names})

  return lowrank_update.factory_compressor(
      cfg,
      axis_name,
      AcpSgdState,
      exchange,
      volume,
      phases,
      packed_rounds=collectives.network_sends_each_operand,
      cycle=tuple(p.value for p in _CYCLE),
  )


def exchange(
    cfg: lowrank.LowRank,
    axis_name: str,
    s: lowrank.Split,
    state: AcpSgdState,
    n: int,
) -> tuple[lowrank_update.Round, AcpSgdState]:
  """A P-step or a Q-step (the state's phase says which) of ``s``'s
  matrices: their round of all-reduces, and the state after it.

  P-step: the basis is orth(Q), the coordinates F = M orth(Q) (n x r), the
  residual E' = M - F orth(Q)^T. Q-step: the basis is orth(P), the
  coordinates F^T = orth(P)^T M (r x m, kept transposed), the residual
  E' = M - orth(P) F^T.
  """
  side, bases, factors, errors = _project(cfg, s, state)
  after = Phase.Q if side is Phase.P else Phase.P
      # Packed, in one bucket, where each array would be its own message.
  packed = collectives.network_sends_each_operand()
  if packed:
    s = s._replace(buckets=buckets.for_packed_rounds(s.buckets))
  reduced, dense = lowrank_update.psum_round(
      s,
      factors,
      s.dense,
      axis_name,
      cfg.comm_dtype,
      packed=packed,
      row_sums=side is Phase.Q,
  )
  reduced = [f / n for f in reduced]
  masked = [optax.MaskedNode()] * len(s.dense)
  kept = lowrank.merge(
      s,
      reduced if side is Phase.P else [ft.T for ft in reduced],
      masked,
      reshape=False,
  )
  new_state = AcpSgdState(
      error=lowrank.errors_tree(cfg, s, errors),
      p=kept if side is Phase.P else state.p,
      q=state.q if side is Phase.P else kept,
      phase=phase_lib.next_marker(state.phase, after),
      count=state.count + 1,
  )
  sent = lowrank_update.Round(s, side, bases, reduced, [x / n for x in dense])
  return sent, new_state


def _project(
    cfg: lowrank.LowRank, s: lowrank.Split, state: AcpSgdState
) -> tuple[Phase, list[jax.Array], list[jax.Array], list[jax.Array]]:
  """The side this step sends (the state's phase), and for each matrix its
  basis, the coordinates it sends (rounded as sent) and its residual."""
  if phase_lib.phase_of(state.phase) is Phase.P:
    previous = lowrank.start_factors(cfg, s, state.q, state.count)
    bases = [orthogonalize.orthogonalize(f) for f in previous]
    factors = [
        lowrank_update.as_sent(cfg, projection.project(m, b))
        for m, b in zip(s.matrices, bases)
    ]
    errors = [
        projection.residual(m, f, projection.transposed_rows(b))
        for m, f, b in zip(s.matrices, factors, bases)
    ]
    return Phase.P, bases, factors, errors
  bases = [
      orthogonalize.orthogonalize_rows(f) for f in lowrank.leaves_of(s, state.p)
  ]
  factors = [
      lowrank_update.as_sent(cfg, projection.project_terms_transposed(m, b))
      for m, b in zip(s.matrices, bases)
  ]
  errors = [
      projection.residual(m, b, ft)
      for m, ft, b in zip(s.matrices, factors, bases)
  ]
  return Phase.Q, bases, factors, errors
