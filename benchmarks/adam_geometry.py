"""The variants of the direction benchmark: Power-SGD and ACP-SGD as they
are, or compressing in Adam's geometry (``GEOMETRY_KINDS``);
``benchmarks.direction``'s docstring gives the arithmetic of each.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import acp_jax
from acp_jax import lowrank
from acp_jax import state_trees

# Adam's moments, for every variant and for S-SGD's reference alike.
B1, B2, EPS = 0.9, 0.99, 1e-8
# The factors' comm_dtype -> the variant name's suffix.
COMM_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}
# Below this fraction of its leaf's mean, a row's or column's second moment
# counts as this fraction: the scaling stays finite on rows never used.
FLOOR = 1e-6


class Scaled(NamedTuple):
  """A compressor's state with a running second moment of its means.

  Attributes:
    inner: the compressor's own state.
    moment: per compressed leaf, the running mean of the squared mean
      gradient: factored, a pair of (n,) (the mean over columns) and (m,)
      (over rows) float32; full, (n, m) float32. Identical on every replica.
    count: int32 scalar, the means seen.
  """

  inner: Any
  moment: list
  count: Any


def _inverse_root(v, count):
  """``v``'s normalized inverse square root, ones before any mean was
  seen."""
  v = v / jnp.maximum(v.mean(), 1e-30)
  d = jnp.sqrt(1.0 / jnp.maximum(v, FLOOR))
  return jnp.where(count > 0, d, jnp.ones_like(d))


class Geometry(NamedTuple):
  """The weights W that a variant compresses M * W in (elementwise), and
  sends back M = approx / W: rank-r preserving when W is an outer product."""

  init: Any  # (n, m) -> zero moment
  weights: Any  # (moment, count) -> (n, m) W
  accumulate: Any  # (moment, mean matrix) -> moment


def _ema(old, new):
  return B2 * old + (1 - B2) * new


def _factored() -> Geometry:
  return Geometry(
      lambda n, m: (jnp.zeros((n,), jnp.float32), jnp.zeros((m,), jnp.float32)),
      lambda v, count: (
          _inverse_root(v[0], count)[:, None] * _inverse_root(v[1], count)
      ),
      lambda v, x: (
          _ema(v[0], jnp.mean(jnp.square(x), 1)),
          _ema(v[1], jnp.mean(jnp.square(x), 0)),
      ),
  )


def _full() -> Geometry:
  return Geometry(
      lambda n, m: jnp.zeros((n, m), jnp.float32),
      _inverse_root,
      lambda v, x: _ema(v, jnp.square(x)),
  )


# name -> (its Geometry, whether the residual stays in the scaled space).
GEOMETRY_KINDS = {
    "factored_scaled": (_factored, True),
    "factored": (_factored, False),
    "full": (_full, False),
}


class Variant:
  """A compressor as measured: its update on one device's gradients, with
  or without the scaling in Adam's geometry."""

  def __init__(
      self,
      method: str,
      rank: int,
      geometry: str | None,
      warmup,
      comm_dtype: str | None = None,
  ):
    self.name = (
        method
        + f"_r{rank}"
        + (f"_{geometry}" if geometry else "")
        + (f"_{COMM_DTYPE_NAMES[comm_dtype]}" if comm_dtype else "")
    )
    self.geometry = None
    if geometry:
      make, self.scaled_residual = GEOMETRY_KINDS[geometry]
      self.geometry = make()
    self.tx = getattr(acp_jax, method)(
        rank,
        warmup_steps=warmup,
        bucket_bytes=float("inf"),
        comm_dtype=comm_dtype,
    )
    self._spec = lambda x: lowrank.matrix_spec(tuple(x.shape), rank, 2.0)

  def init(self, params):
    inner = self.tx.init(params)
    if self.geometry is None:
      return inner
    specs = [self._spec(x) for x in jax.tree.leaves(params)]
    return Scaled(
        inner,
        [self.geometry.init(s.n, s.m) for s in specs if s],
        jnp.zeros((), jnp.int32),
    )

  def at_step(self, state, step: int):
    if self.geometry is None:
      return self.tx.at_step(state, step)
    return state._replace(inner=self.tx.at_step(state.inner, step))

  def local_fields(self, state) -> Any:
    """``state`` with True at the fields that differ across devices."""
    inner = state.inner if self.geometry else state
    flags = type(inner)(*(f in self.tx.local_fields for f in inner._fields))
    if self.geometry is None:
      return flags
    return Scaled(flags, False, False)

  def device_axes(self, state) -> Any:
    """``state``'s mapped axes: 0 at the fields that differ across devices
    (they carry a leading device axis), None at those held once."""
    return jax.tree.map(
        lambda local: 0 if local else None,
        self.local_fields(state),
        is_leaf=lambda x: isinstance(x, bool),
    )

  def _per_matrix(self, xs, weights, fn):
    """``fn(x as n x m, W)`` at the compressed leaves of ``xs``."""
    out, it = list(xs), iter(weights)
    for i, x in enumerate(xs):
      spec = self._spec(x) if not state_trees.is_masked(x) else None
      if spec:
        out[i] = fn(x.reshape(spec.n, spec.m), next(it)).reshape(x.shape)
    return out

  def update(self, grads, state):
    """The compressed mean of one device's ``grads``, inside the mapping."""
    if self.geometry is None:
      return self.tx.update(grads, state)
    g = self.geometry
    leaves, treedef = jax.tree.flatten(grads)
    weights = [g.weights(v, state.count) for v in state.moment]
    scaled = self._per_matrix(leaves, weights, lambda x, w: x * w)
    mean, inner = self.tx.update(
        jax.tree.unflatten(treedef, scaled), state.inner
    )
    mean = self._per_matrix(jax.tree.leaves(mean), weights, lambda x, w: x / w)
    matrices = [
        x.reshape(spec.n, spec.m) for x in mean if (spec := self._spec(x))
    ]
    moment = [g.accumulate(v, x) for v, x in zip(state.moment, matrices)]
    count = state.count + 1
    if not self.scaled_residual and "error" in inner._fields:
      # The residual, stored scaled by the old W, is re-expressed in the new
      # one: the unscaled residual is kept.
      ratios = [g.weights(v, count) / w for v, w in zip(moment, weights)]
      errors = state_trees.state_leaves(inner.error)
      errors = self._per_matrix(errors, ratios, lambda e, r: e * r)
      inner = inner._replace(
          error=jax.tree.unflatten(
              jax.tree.structure(inner.error, is_leaf=state_trees.is_masked),
              errors,
          )
      )
    return jax.tree.unflatten(treedef, mean), Scaled(inner, moment, count)
