"""Adam with its first moment compressed: 1-bit Adam's scheme, at low rank."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from acp_jax import _checks
from acp_jax import compressor as compressor_lib
from acp_jax import phase as phase_lib
from acp_jax import wrapped

# The factories whose compressors it wraps: S-SGD (every step dense, so it
# is Adam itself) and the low-rank ones, whose dense warm-up feeds Adam's
# second moment before it is frozen.
_EXACT = "ssgd"
_WITH_WARMUP = ("power_sgd", "acp_sgd")


class CompressedAdamState(NamedTuple):
  """State of ``compressed_adam``.

  Attributes:
    local: the wrapped compressor's per-device fields (its residuals), in the
      order of its ``local_fields``; they differ across devices.
    inner: the wrapped compressor's state, None at those fields; identical
      on every replica.
    adam: Adam's ``optax.ScaleByAdamState``: the step count (int32 scalar)
      and the moments mu and nu, like the params; identical on every
      replica. nu holds its value of the last dense step once compression
      starts.
  """

  local: tuple
  inner: Any
  adam: optax.ScaleByAdamState

  phase = wrapped.PHASE
  count = wrapped.COUNT


def compressed_adam(
    compressor: compressor_lib.Compressor,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    preconditioned: bool = False,
) -> compressor_lib.Compressor:
  """Adam whose first moment, not the gradient, goes through ``compressor``.

  During the compressor's dense warm-up each step is Adam's on the exact
  mean gradient. From the first compressed step on, Adam's second moment nu
  is frozen (as in 1-bit Adam) and each device i folds its own gradient G_i
  into the shared first moment mu; the compressor, with its error feedback
  and warm-started factors, averages the result::

    dense:       g = allreduce_mean(G_i)
                 mu = b1 mu + (1 - b1) g;  nu = b2 nu + (1 - b2) g^2
    compressed:  mu = compressor_mean(b1 mu + (1 - b1) G_i);  nu unchanged
    update = mu_hat / (sqrt(nu_hat) + eps)

  With ``preconditioned``, what is compressed is each device's momentum in
  Adam's geometry, (b1 mu + (1 - b1) G_i) / (sqrt(nu_hat) + eps): its mean
  is the update itself, and mu is that mean times sqrt(nu_hat) + eps. The
  scaling is fixed once nu is frozen, so the residual that error feedback
  keeps stays in one space, and the rank-r error is chosen in the norm of
  the update rather than amplified where nu is small.

  with ``optax.scale_by_adam``'s bias corrections (nu_hat's from the last
  dense step on). The momentum changes slowly from step to step, so a
  warm-started rank-r factor tracks it more closely than it tracks the raw
  gradient, and the residual that error feedback carries stays small. What
  is sent per step is what ``compressor`` sends: the momentum has the
  gradient's shapes.

  Args:
    compressor: ``acp_jax.ssgd(...)`` (then every step is Adam's) or
      ``acp_jax.power_sgd`` / ``acp_jax.acp_sgd`` with ``warmup_steps`` of
      at least 1, the steps on which nu is estimated.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to sqrt(nu_hat), > 0.
    preconditioned: compress the momentum divided by sqrt(nu_hat) + eps.

  Returns:
    A ``Compressor`` whose update, inside the mapping, takes this device's
    gradients and returns Adam's preconditioned direction (the same on every
    replica). Chain it with what follows ``scale_by_adam`` in
    ``optax.adamw``: ``dp.chain(optax.chain(optax.add_decayed_weights(wd),
    optax.scale_by_learning_rate(lr)))``.

  Example::

    dp = acp_jax.DataParallel(
        acp_jax.compressed_adam(acp_jax.acp_sgd(8, warmup_steps=60)), mesh
    )
    tx = dp.chain(optax.scale_by_learning_rate(1e-3))

  .. warning::
    Do not chain ``optax.adam`` after it: it is Adam already.
    ``DataParallel.chain`` refuses it (and other preconditioners) at
    ``init``; a hand-written ``optax.chain`` cannot tell.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed", ICML 2021.
    https://arxiv.org/abs/2102.02888
  """
  _check_args(compressor, b1, b2, eps, preconditioned)
  name = compressor.made_by[0]
  adam = optax.scale_by_adam(b1, b2, eps)
  local = wrapped.Local(compressor)

  def init_fn(params):
    fields, inner = local.split(compressor.init(params))
    return CompressedAdamState(fields, inner, adam.init(params))

  def update_fn(updates, state, params=None):
    del params
    _checks.begin_update(updates, compressor.axis_name, "compressed_adam")
    _checks.check_state(state, CompressedAdamState, "compressed_adam")
    inner = local.join(state)
    if (
        name == _EXACT
        or phase_lib.phase_of(inner.phase) is phase_lib.Phase.DENSE
    ):
      mean, inner = compressor.update(updates, inner)
      direction, moments = adam.update(mean, state.adam)
    else:
      moment = optax.tree.update_moment(updates, state.adam.mu, b1, 1)
      # nu stopped at the last dense step, the warm-up's last.
      nu_hat = optax.tree.bias_correction(
          state.adam.nu, b2, jnp.asarray(compressor.warmup_steps, jnp.int32)
      )
      scale = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu_hat)
      count = numerics.safe_increment(state.adam.count)
      if preconditioned:
        mean, inner = compressor.update(
            jax.tree.map(jnp.divide, moment, scale), inner
        )
        mu = jax.tree.map(jnp.multiply, mean, scale)
        direction = optax.tree.bias_correction(mean, b1, count)
      else:
        mu, inner = compressor.update(moment, inner)
        direction = jax.tree.map(
            jnp.divide, optax.tree.bias_correction(mu, b1, count), scale
        )
      moments = state.adam._replace(count=count, mu=mu)
    fields, inner = local.split(inner)
    return direction, CompressedAdamState(fields, inner, moments)

  return wrapped.around(
      compressor,
      init_fn,
      update_fn,
      "compressed_adam",
      {"b1": b1, "b2": b2, "eps": eps, "preconditioned": preconditioned},
  )


def _check_args(
    compressor: Any, b1: float, b2: float, eps: float, preconditioned: bool
) -> None:
  """Refuses ``compressed_adam``'s arguments where they are not usable: a
  compressor without a dense warm-up, moments' rates outside [0, 1)."""
  name = wrapped.check_args(
      "compressed_adam",
      compressor,
      (_EXACT, *_WITH_WARMUP),
      "the others have no dense warm-up on which Adam's second moment could"
      " be estimated.",
      b1,
      b2,
      eps,
      preconditioned=preconditioned,
  )
  if name != _EXACT and not compressor.warmup_steps:
    raise ValueError(
        f"compressed_adam: {name} has warmup_steps={compressor.warmup_steps};"
        " Adam's second moment is estimated on the dense warm-up steps and"
        f" then frozen, so make it with {name}(..., warmup_steps=N), N >= 1."
    )
