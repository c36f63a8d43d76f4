"""ACP-SGD: Power-SGD's two halves, alternated across steps."""

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from acp_jax import compressor
from acp_jax import lowrank


class Phase(enum.Enum):
  """Which factor an ACP-SGD step computes and all-reduces."""

  P = "p"
  Q = "q"


# The phase is carried by the *shape* of a tiny array in the state. Its shape
# is static to jit, which compiles one variant per phase, each holding only
# its own all-reduce, so no collective sits inside a run-time conditional.
# Being an array, it survives every path that keeps only array values
# (nnx.Optimizer, orbax), and paths that need a fixed state type (lax.scan
# carries, lax.cond) refuse it when tracing instead of training something
# else. (Orbax cannot save zero-size arrays, hence sizes 1 and 2.)
_PHASE_SIZE = {Phase.P: 1, Phase.Q: 2}


def phase_marker(phase: Phase) -> jax.Array:
  """The array whose shape records ``phase`` in an ``AcpSgdState``."""
  return jnp.zeros((_PHASE_SIZE[phase],), jnp.uint8)


def phase_of(marker) -> Phase:
  """The phase that an ``AcpSgdState.phase`` (or its abstract shape) records."""
  for phase, size in _PHASE_SIZE.items():
    if tuple(marker.shape) == (size,):
      return phase
  raise ValueError(
      f"an ACP-SGD phase marker has shape (1,) or (2,), got {marker.shape}"
  )


class AcpSgdState(NamedTuple):
  """State of ``acp_sgd``; ``MaskedNode`` at leaves sent dense.

  Attributes:
    error: residual E per compressed leaf, leaf shape and dtype; differs
      across devices.
    p: (n, r) mean of the last P-step's all-reduced P, leaf dtype.
    q: (m, r) mean of the last Q-step's all-reduced Q, leaf dtype (before the
      first Q-step: random from the seed).
    phase: uint8 zeros whose shape says which factor the next step
      computes: (1,) P, (2,) Q (see ``phase_of``).
  """

  error: optax.Updates
  p: optax.Updates
  q: optax.Updates
  phase: jax.Array

  @property
  def next_phase(self) -> Phase:
    return phase_of(self.phase)


def acp_sgd(
    rank: int,
    *,
    axis_name: str = "data",
    min_compression_rate: float = 2.0,
    seed: int = 0,
    keep_dense: compressor.KeepDense = None,
    bucket_bytes: float | None = None,
) -> compressor.Compressor:
  """ACP-SGD: alternate compressed Power-SGD, one all-reduce a step.

  Each compressed leaf is viewed as an n x m matrix (``lowrank.matrix_spec``),
  M = G + E its local gradient plus residual. Steps alternate::

    P-step:  Q' = orth(Q);  P = M Q';  E = M - P Q'^T
             P = allreduce_sum(P) / N;  update = P Q'^T
    Q-step:  P' = orth(P);  Q = M^T P';  E = M - P' Q^T
             Q = allreduce_sum(Q) / N;  update = P' Q^T

  The factor each step projects onto comes from the previous step, so nothing
  in a step waits on that step's own communication: its one round of
  all-reduces (factors plus the leaves sent dense) can fuse and overlap like
  S-SGD's, at about half Power-SGD's volume. The leaves travel in buckets, as
  S-SGD's do, each bucket's factors packed into one all-reduce that waits
  only for its own leaves' gradients (see ``acp_jax.collectives``). The
  phase lives in the state's structure: a jitted step compiles once per
  phase.

  Args:
    rank: rank r of the factors, clipped per leaf to min(n, m).
    axis_name: the mapped axis over which devices hold their data shards.
    min_compression_rate: a matrix is compressed only if the factors are at
      least this many times smaller than it (PyTorch's default, 2).
    seed: seed of the initial Q, the same on every replica.
    keep_dense: a tree of bools like the params, or a function of the params
      returning one, marking leaves to send uncompressed.
    bucket_bytes: uncompressed gradient bytes per bucket, so a bucket's
      factors take about this divided by the compression ratio (the paper's
      scaled fusion buffer); None for 25 MiB (PyTorch DDP's default),
      ``math.inf`` for one all-reduce per dtype.

  Returns:
    A ``Compressor`` whose update, called inside ``jax.shard_map`` or
    ``jax.pmap`` over ``axis_name`` with this device's gradients, returns the
    approximate mean gradient over the axis.

  Example::

    tx = optax.chain(acp_jax.acp_sgd(rank=4), optax.sgd(0.1, momentum=0.9))

  .. warning::
    Put it first in the chain: it must see each device's own gradients, or
    use ``acp_jax.DataParallel``. The shape of the state's ``phase`` array
    alternates, so a ``lax.scan`` over steps must take two steps per
    iteration.

  References:
    Zhang et al., "Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning", ICDCS 2023. https://arxiv.org/abs/2306.08881
  """
  lr = lowrank.settings(
      rank, min_compression_rate, keep_dense, seed, "acp_sgd", bucket_bytes
  )

  def init_fn(params):
    error, p, q = lowrank.init_trees(lr, params)
    return AcpSgdState(error=error, p=p, q=q, phase=phase_marker(Phase.P))

  def update_fn(updates, state, params=None):
    del params
    n = compressor.begin_update(updates, axis_name, "acp_sgd")
    compressor.check_state(state, AcpSgdState, "acp_sgd")
    s = lowrank.split(lr, updates, state.error)
    lowrank.check_factors(lr, s, state.q, "m")
    # P-step: F = M B, approximation F B^T. Q-step: F^T = B^T M (kept
    # transposed, see lowrank.project_transposed), approximation B F^T.
    p_step = phase_of(state.phase) is Phase.P
    if p_step:
      project, expand = (lambda m, b: m @ b), (lambda f, b: f @ b.T)
    else:
      project, expand = lowrank.project_transposed, (lambda ft, b: b @ ft)
    previous = lowrank.leaves_of(s, state.q if p_step else state.p)
    bases = [lowrank.orthogonalize(f) for f in previous]
    factors = [project(m, b) for m, b in zip(s.matrices, bases)]
    errors = [m - expand(f, b) for m, f, b in zip(s.matrices, factors, bases)]
    # The one round: each bucket's factors and dense leaves together.
    reduced, dense = lowrank.psum_round(s, factors, s.dense, axis_name)
    reduced = [f / n for f in reduced]
    dense = [x / n for x in dense]
    applied = [expand(f, b) for f, b in zip(reduced, bases)]
    masked = [optax.MaskedNode()] * len(s.dense)
    reduced_tree = lowrank.merge(
        s,
        reduced if p_step else [ft.T for ft in reduced],
        masked,
        reshape=False,
    )
    new_state = AcpSgdState(
        error=lowrank.merge(s, errors, masked, reshape=True),
        p=reduced_tree if p_step else state.p,
        q=state.q if p_step else reduced_tree,
        # Made from the old marker, so that the step always reads one of its
        # inputs (a shard_map whose inputs are all unused or empty fails to
        # compile under Shardy, jax 0.10.2).
        phase=jnp.broadcast_to(
            state.phase[:1], phase_marker(Phase.Q if p_step else Phase.P).shape
        ),
    )
    return lowrank.merge(s, applied, dense, reshape=True), new_state

  def volume(params, num_devices):
    del num_devices
    phase_volume = lambda rows: compressor.CommVolume(
        all_reduce=lowrank.volume(lr, params, rows)
    )
    return {
        "p": phase_volume(lambda spec: spec.n),
        "q": phase_volume(lambda spec: spec.m),
    }

  def phases(state):
    # Abstract markers, for lowering each phase's step.
    marker = lambda phase: jax.ShapeDtypeStruct(
        (_PHASE_SIZE[phase],),
        jnp.uint8,
        sharding=getattr(state.phase, "sharding", None),
    )
    return {phase.value: state._replace(phase=marker(phase)) for phase in Phase}

  return compressor.Compressor(
      init_fn,
      update_fn,
      volume,
      axis_name=axis_name,
      phases=phases,
      bucket_bytes=lr.bucket_bytes,
  )
