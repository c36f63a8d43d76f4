"""Adam in the subspace that a low-rank compressor all-reduces."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from acp_jax import _checks
from acp_jax import acp
from acp_jax import compressor as compressor_lib
from acp_jax import lowrank
from acp_jax import phase as phase_lib
from acp_jax import powersgd
from acp_jax import state_trees
from acp_jax import wrapped

Phase = phase_lib.Phase

# The low-rank factories it wraps, and their compressing steps.
_EXCHANGES = {"acp_sgd": acp.exchange, "power_sgd": powersgd.exchange}


class Moments(NamedTuple):
  """Adam's moments of the compressed leaves in one side's coordinates
  (see ``lowrank.Round``), and the basis they are coordinates on; trees
  like the params, ``MaskedNode`` at the leaves sent dense.

  Attributes:
    mu: first moment: n x r on side P, r x m on side Q.
    nu: second moment, the same shapes.
    basis: the orthonormal basis: m x r on side P, n x r on side Q.
  """

  mu: Any
  nu: Any
  basis: Any


class SubspaceAdamState(NamedTuple):
  """State of ``subspace_adam``.

  Attributes:
    local, inner: the wrapped compressor's state, its per-device fields
      apart (``acp_jax.wrapped.Local``).
    dense: Adam's moments of the leaves sent dense (``optax``'s
      ``ScaleByAdamState``, ``MaskedNode`` at the compressed leaves); its
      count is the steps taken.
    on_p: the moments of the compressed leaves after a side-P step
      (ACP-SGD's P-step; all ``MaskedNode`` for Power-SGD, which has none).
    on_q: the moments after a side-Q step (ACP-SGD's Q-step, Power-SGD's
      step, a dense warm-up step).

  Every field but ``local`` is identical on every replica.
  """

  local: tuple
  inner: Any
  dense: optax.ScaleByAdamState
  on_p: Moments
  on_q: Moments

  phase = wrapped.PHASE
  count = wrapped.COUNT


def subspace_adam(
    compressor: compressor_lib.Compressor,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    moment_feedback: bool = True,
    track_momentum: bool = False,
    match_rms: bool = False,
) -> compressor_lib.Compressor:
  """Adam run on the coordinates that ``compressor`` all-reduces.

  A low-rank step averages, for each compressed n x m leaf, its coordinates
  C on an orthonormal basis B that every replica shares (see
  ``lowrank.Round``): n x r on a right basis in ACP-SGD's P-steps, r x m on
  a left basis in its Q-steps and in Power-SGD's steps. Adam's moments live
  in those coordinates, identical on every replica, and the update is the
  basis times Adam's step on them::

    mu, nu = carried from the last step's basis to B (below)
    mu = b1 mu + (1 - b1) C;  nu = b2 nu + (1 - b2) C^2
    update = B-expand(mu_hat / (sqrt(nu_hat) + eps))

  with ``optax.scale_by_adam``'s bias corrections; the leaves sent dense
  (vectors, small matrices) take Adam's own step on their mean. Nothing more
  is sent than ``compressor`` sends, and the moments take (n + m) r floats
  per matrix where AdamW's take 2 n m.

  When the basis changes (every step), the moments are carried by the
  projection-aware rule of LDAdam (``carry``): mu is projected onto the new
  basis (the old n x m moment's coordinates on it, from products of r x r
  and n x r or r x m factors, never n x m); nu is carried as the variance
  nu_hat - mu_hat^2 transformed with the squared coefficients of that
  change (each coordinate taken as independent), plus mu'^2. A change
  between sides (ACP-SGD's alternation) is one more such linear map.

  Error feedback keeps what each step loses: the compressor's own residual
  (M minus what was sent) and, with ``moment_feedback``, the part of the
  first moment that the change of basis dropped, times b1 / (1 - b1), so
  that the next step's gradient puts it back into mu. During the
  compressor's dense warm-up, each step is a power-iteration step on the
  exact mean: Adam runs on its coordinates, and what lies outside the basis
  is kept as every device's residual.

  Args:
    compressor: ``acp_jax.acp_sgd`` or ``acp_jax.power_sgd``.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to sqrt(nu_hat), > 0.
    moment_feedback: keep the first moment's loss at a change of basis in
      the residual (needs the compressor's ``use_error_feedback``).
    track_momentum: the next step's basis comes from the first moment's
      coordinates, not from the mean gradient's: the compressor's power
      iteration then runs on the momentum, as LDAdam's does (with warm
      start; identical on every replica, no byte more).
    match_rms: scale each compressed leaf's step by sqrt(k / r), k the
      dimension its basis spans (n on side Q, m on side P): Adam's step is
      about 1 per coordinate, so k x r coordinates expanded over n x m
      entries have a root mean square of sqrt(r / k), and this brings it to
      Adam's on the whole matrix (GaLore's scale, set from the shapes).

  Returns:
    A ``Compressor`` whose update, inside the mapping, takes this device's
    gradients and returns Adam's direction, the same on every replica.
    Chain it with what follows ``scale_by_adam`` in ``optax.adamw``:
    ``dp.chain(optax.chain(optax.add_decayed_weights(wd),
    optax.scale_by_learning_rate(lr)))``.

  Example::

    dp = acp_jax.DataParallel(acp_jax.subspace_adam(acp_jax.acp_sgd(8)), mesh)
    tx = dp.chain(optax.scale_by_learning_rate(1e-3))

  .. warning::
    Do not chain ``optax.adam`` after it: it is Adam already.

  References:
    Robert, Safaryan, Modoranu and Alistarh, "LDAdam: Adaptive Optimization
    from Low-Dimensional Gradient Statistics", ICLR 2025.
    https://arxiv.org/abs/2410.16103
  """
  name = wrapped.check_args(
      "subspace_adam",
      compressor,
      tuple(_EXCHANGES),
      "only a low-rank compressor all-reduces coordinates on a shared basis"
      " in which Adam's moments can live.",
      b1,
      b2,
      eps,
      moment_feedback=moment_feedback,
      track_momentum=track_momentum,
      match_rms=match_rms,
  )
  cfg = lowrank.from_made_by(name, compressor.made_by[1])
  axis_name = compressor.axis_name
  exchange = _EXCHANGES[name]
  local = wrapped.Local(compressor)
  feedback = moment_feedback and cfg.use_error_feedback

  adam = _Adam(b1, b2, eps)

  def init_fn(params):
    fields, inner = local.split(compressor.init(params))
    return _initial(cfg, params, fields, inner, both_sides=name == "acp_sgd")

  def update_fn(updates, state, params=None):
    del params
    n = _checks.begin_update(updates, axis_name, "subspace_adam")
    _checks.check_state(state, SubspaceAdamState, "subspace_adam")
    inner = local.join(state)
    s = lowrank.split_state(cfg, updates, inner)
    phase = phase_lib.phase_of(inner.phase)
    if phase is Phase.DENSE:
      lowrank.check_dense_step(cfg, inner.count)
      mean, errors, q, sent = lowrank.dense_step(cfg, s, inner.q, axis_name)
      inner = inner._replace(error=errors, q=q, count=inner.count + 1)
    else:
      sent, inner = exchange(cfg, axis_name, s, inner, n)
    # The moments are on side P after a P-step (the next step is a Q-step),
    # else on side Q (after a Q-step, a Power-SGD step, a dense step).
    old_side = Phase.P if phase is Phase.Q else Phase.Q
    old = state.on_p if old_side is Phase.P else state.on_q
    t = state.dense.count
    steps, kept, lost = adam.in_subspace(
        (old_side, old), sent, t, match_rms
    )
    dense_steps, dense = adam.dense(s, state.dense, sent.dense)
    direction = lowrank.merge(s, steps, dense_steps, reshape=True)
    masked = [optax.MaskedNode()] * len(s.dense)
    new = Moments(*[lowrank.merge(s, x, masked, reshape=False) for x in kept])
    on_p, on_q = (new, state.on_q) if sent.side is Phase.P else (
        state.on_p, new
    )
    errors = inner.error
    if phase is Phase.DENSE and cfg.use_error_feedback:
      # The dense step sent everything; what Adam's basis leaves out of the
      # exact mean stays for the next step, on every device alike.
      outside = [
          x - lowrank.expand(sent.side, b, c).reshape(x.shape)
          for x, b, c in zip(
              lowrank.leaves_of(s, mean), sent.bases, sent.coords
          )
      ]
      errors = lowrank.errors_tree(cfg, s, outside)
    if feedback:
      kept_too = [
          e + (b1 / (1 - b1)) * d.reshape(e.shape)
          for e, d in zip(lowrank.leaves_of(s, errors), lost)
      ]
      errors = lowrank.errors_tree(cfg, s, kept_too)
    inner = inner._replace(error=errors)
    if track_momentum:
      # The factor the next step projects on: the moment's, not the mean's.
      factor = "p" if sent.side is Phase.P else "q"
      moment = [mu if sent.side is Phase.P else mu.T for mu in kept.mu]
      inner = inner._replace(
          **{factor: lowrank.merge(s, moment, masked, reshape=False)}
      )
    fields, inner = local.split(inner)
    return direction, SubspaceAdamState(fields, inner, dense, on_p, on_q)

  return wrapped.around(
      compressor,
      init_fn,
      update_fn,
      "subspace_adam",
      {
          "b1": b1,
          "b2": b2,
          "eps": eps,
          "moment_feedback": moment_feedback,
          "track_momentum": track_momentum,
          "match_rms": match_rms,
      },
  )


def _initial(cfg, params, fields, inner, both_sides: bool):
  """The state before the first step: zero moments and bases (side P's only
  for ACP-SGD, whose P-steps put them there)."""
  specs = cfg.plan(params)
  leaves, treedef = jax.tree.flatten(params)
  masked = optax.MaskedNode()

  def tree(compressed=None, dense=False):
    """Zeros of ``compressed``'s dims (names of a ``MatrixSpec``) at the
    compressed leaves, or like the leaf at the dense ones if ``dense``."""
    out = []
    for x, spec in zip(leaves, specs):
      if spec is None:
        out.append(jnp.zeros_like(x) if dense else masked)
      elif compressed is None:
        out.append(masked)
      else:
        shape = [getattr(spec, d) for d in compressed]
        out.append(jnp.zeros(shape, x.dtype))
    return jax.tree.unflatten(treedef, out)

  on_q = Moments(tree(("rank", "m")), tree(("rank", "m")), tree(("n", "rank")))
  on_p = Moments(tree(), tree(), tree())
  if both_sides:
    on_p = Moments(
        tree(("n", "rank")), tree(("n", "rank")), tree(("m", "rank"))
    )
  dense = optax.ScaleByAdamState(
      count=jnp.zeros((), jnp.int32), mu=tree(dense=True), nu=tree(dense=True)
  )
  return SubspaceAdamState(fields, inner, dense, on_p, on_q)


class _Adam(NamedTuple):
  """Adam's rule, on the coordinates of a round and on the dense leaves."""

  b1: float
  b2: float
  eps: float

  def accumulate(self, mu, nu, g):
    return self.b1 * mu + (1 - self.b1) * g, self.b2 * nu + (
        1 - self.b2
    ) * jnp.square(g)

  def scaled(self, mu, nu, count):
    """The bias-corrected step from the moments after ``count`` steps."""
    mu_hat = optax.tree.bias_correction(mu, self.b1, count)
    nu_hat = optax.tree.bias_correction(nu, self.b2, count)
    return mu_hat / (jnp.sqrt(nu_hat) + self.eps)

  def in_subspace(self, old, sent: lowrank.Round, count, match_rms: bool):
    """Each compressed matrix's step on the round's basis, the moments
    kept (mu, nu, basis lists) and the first moment's loss at the change
    of basis, from ``old = (side, Moments)`` after ``count`` steps."""
    old_side, moments = old
    s = sent.split
    olds = [lowrank.leaves_of(s, x) for x in moments]
    steps, lost, kept = [], [], Moments([], [], [])
    for mu, nu, old_basis, basis, coords in zip(
        *olds, sent.bases, sent.coords
    ):
      mu, nu, dropped = carry(
          (old_side, old_basis, mu, nu),
          (sent.side, basis),
          count,
          self.b1,
          self.b2,
      )
      mu, nu = self.accumulate(mu, nu, coords)
      step = self.scaled(mu, nu, optax.safe_increment(count))
      if match_rms:
        step = step * (basis.shape[0] / basis.shape[1]) ** 0.5
      steps.append(lowrank.expand(sent.side, basis, step))
      lost.append(dropped)
      for field, x in zip(kept, (mu, nu, basis)):
        field.append(x)
    return steps, kept, lost

  def dense(self, s: lowrank.Split, state: optax.ScaleByAdamState, means):
    """Adam's steps on the leaves sent dense, and its state after them."""
    count = optax.safe_increment(state.count)
    mus, nus = [], []
    for mu, nu, g in zip(
        _dense_leaves(s, state.mu), _dense_leaves(s, state.nu), means
    ):
      mu, nu = self.accumulate(mu, nu, g)
      mus.append(mu)
      nus.append(nu)
    masked = [optax.MaskedNode()] * len(s.matrices)
    after = optax.ScaleByAdamState(
        count=count,
        mu=lowrank.merge(s, masked, mus, reshape=False),
        nu=lowrank.merge(s, masked, nus, reshape=False),
    )
    return [self.scaled(m, v, count) for m, v in zip(mus, nus)], after


def carry(
    old: tuple[Phase, jax.Array, jax.Array, jax.Array],
    new: tuple[Phase, jax.Array],
    count: jax.Array,
    b1: float,
    b2: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Adam's moments of one matrix re-expressed on a new basis.

  Args:
    old: ``(side, basis, mu, nu)``: the moments' coordinates on ``basis``.
    new: ``(side, basis)``: the basis to carry them to.
    count: the steps the moments have taken (their bias corrections').
    b1, b2: the moments' decays.

  Returns:
    ``(mu, nu, lost)``: the moments on the new basis, and the n x m part of
    the first moment that the new basis leaves out.

  The new coordinates of the old first moment are L mu R, with (old side,
  new side) -> (L, R): (Q, Q) -> (B'^T B, 1), (P, P) -> (1, B^T B'),
  (Q, P) -> (B, B'), (P, Q) -> (B'^T, B^T), for the old basis B and the new
  B'. The variance nu_hat - mu_hat^2, its coordinates taken as independent,
  goes through L^2 and R^2 (squared elementwise); mu'^2 is added back and
  the bias correction restored (LDAdam's rule). No n x m matrix is formed
  but ``lost``.
  """
  old_side, old_basis, mu, nu = old
  side, basis = new
  t = count.astype(jnp.float32)
  # Before the first step the moments are zero: the corrections are 0/tiny.
  c1 = jnp.maximum(1 - b1**t, 1e-30).astype(mu.dtype)
  c2 = jnp.maximum(1 - b2**t, 1e-30).astype(mu.dtype)
  variance = nu / c2 - jnp.square(mu / c1)
  if old_side is side:
    change = basis.T @ old_basis  # r x r
    left, right = (change, None) if side is Phase.Q else (None, change.T)
  elif side is Phase.P:
    left, right = old_basis, basis
  else:
    left, right = basis.T, old_basis.T

  def through(x, square):
    f = jnp.square if square else lambda a: a
    if side is Phase.P:  # n x r: the small product on the right first
      x = x if right is None else x @ f(right)
      return x if left is None else f(left) @ x
    x = x if left is None else f(left) @ x
    return x if right is None else x @ f(right)

  new_mu = through(mu, False)
  new_nu = jnp.abs(through(variance, True) + jnp.square(new_mu / c1)) * c2
  lost = lowrank.expand(old_side, old_basis, mu) - lowrank.expand(
      side, basis, new_mu
  )
  return new_mu, new_nu, lost


def _dense_leaves(s: lowrank.Split, tree: Any) -> list[jax.Array]:
  """Leaves of a state tree at the positions ``s`` sends dense."""
  return [
      x
      for x, spec in zip(state_trees.state_leaves(tree), s.specs)
      if spec is None
  ]
