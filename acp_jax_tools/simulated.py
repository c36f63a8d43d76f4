"""Devices simulated by ``jax.vmap``: a compressor's mean of several devices'
gradients computed on one device, and the measures of how far it lies from
the true mean: the cosine, and the squared distance beside the sampling
noise that the true mean itself carries.

Under ``jax.vmap`` over the compressor's axis name, its collectives run in one
program on one device: the same arithmetic as under ``shard_map``, with no
threads to wait on each other. The fields of the state that differ across
devices (``Compressor.local_fields``, the residuals) carry a leading device
axis; the others, identical on every replica, are held once.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from acp_jax import _checks
from acp_jax import compressor as compressor_lib


def cosine(a: Any, b: Any) -> jax.Array:
  """The cosine between two trees, as vectors of all their leaves."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  dot = sum(jnp.vdot(x, y) for x, y in zip(la, lb))
  na = sum(jnp.vdot(x, x) for x in la)
  nb = sum(jnp.vdot(y, y) for y in lb)
  return dot / jnp.sqrt(na * nb)


def squared_distance(a: Any, b: Any) -> jax.Array:
  """The squared Euclidean distance between two trees, as vectors of all
  their leaves."""
  return sum(
      jnp.sum(jnp.square(x - y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def sampling_noise(stacked: Any) -> jax.Array:
  """How far the mean of devices' gradients (each leaf stacked on a leading
  device axis) is expected to lie from the true gradient, squared: the
  variance of a mean of ``n`` samples, estimated from their spread,
  ``sum_i |g_i - mean|^2 / (n (n - 1))``; 0 for one device."""
  n = jax.tree.leaves(stacked)[0].shape[0]
  if n < 2:
    return jnp.zeros(())
  mean = jax.tree.map(lambda g: g.mean(0), stacked)
  spread = sum(
      jnp.sum(jnp.square(g - m[None]))
      for g, m in zip(jax.tree.leaves(stacked), jax.tree.leaves(mean))
  )
  return spread / (n * (n - 1))


def device_axes(tx: compressor_lib.Compressor, state: Any) -> Any:
  """``tx``'s ``state`` with 0 at its local fields (a leading device axis)
  and None at the fields held once."""
  return type(state)(
      *(0 if f in tx.local_fields else None for f in state._fields)
  )


def _is_axis(x: Any) -> bool:
  return x is None or isinstance(x, int)


class Devices:
  """An update, compiled for ``num_devices`` devices simulated by
  ``jax.vmap``, and the state it carries from call to call.

  Args:
    update: ``(one device's grads, state) -> (mean, state)``, which
      communicates over ``axis_name``.
    state: the state of one device.
    axes: ``state``'s mapped axes: 0 at the fields that differ across
      devices, None at those held once (``device_axes``).
    axis_name: the axis ``update`` communicates over.
    num_devices: how many devices to simulate.

  Example::

    tx = acp_jax.acp_sgd(4)
    state = tx.init(params)
    devices = Devices(
        tx.update, state, device_axes(tx, state), tx.axis_name, 8
    )
    mean = devices(stacked_grads)  # each leaf [8, ...] -> its mean [...]
  """

  def __init__(
      self,
      update: Callable[[Any, Any], tuple[Any, Any]],
      state: Any,
      axes: Any,
      axis_name: str,
      num_devices: int,
  ):
    def placed_update(grads, state):
      # The update stands alone here, so nothing follows it that could see
      # each device's own gradient.
      with _checks.placed():
        return update(grads, state)

    self._update = jax.jit(
        jax.vmap(
            placed_update,
            in_axes=(0, axes),
            out_axes=(None, axes),
            axis_name=axis_name,
        )
    )
    self.state = jax.tree.map(
        lambda a, sub: jax.tree.map(
            lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), sub
        )
        if a == 0
        else sub,
        axes,
        state,
        is_leaf=_is_axis,
    )

  def __call__(self, grads: Any) -> Any:
    """The compressed mean of ``grads`` (each leaf stacked on a leading
    device axis); the state moves on."""
    mean, self.state = self._update(grads, self.state)
    return mean
