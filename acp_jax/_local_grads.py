"""Each device's local gradients: their type, and the program that makes them.

``jax.shard_map`` runs with ``check_vma=False``, so that ``jax.grad`` adds
no dense all-reduce of its own.
"""

from collections.abc import Mapping
import sys
from typing import Any, Callable

import jax
from jax import lax
from jax.extend import random as jex_random
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from acp_jax import _specs


# How to use local gradients, for every error that meets them.
_FIX = (
    "add them with +, scale them with * or /, and read the arrays from"
    " .stacked (each leaf num_devices x the param's shape). Only"
    " DataParallel.chain(tx) takes them, and a transform placed before"
    " dp.chain goes inside it, after the compressor, e.g."
    " dp.chain(optax.chain(optax.clip_by_global_norm(1.0), opt))"
)


class LocalGradsError(TypeError, AttributeError):
  """``LocalGrads`` used as an array; the message says how to use them.

  An ``AttributeError`` too, so ``getattr(x, "shape", None)`` still works."""


def flax_nnx():
  """``flax.nnx`` if the caller has imported it (we never import flax)."""
  return sys.modules.get("flax.nnx")


class LocalGrads:
  """Each device's gradients, stacked: what ``DataParallel.value_and_grad``
  returns, and what only ``DataParallel.chain(tx)`` takes.

  Local gradients are not the gradient: a transform applied to them
  (clipping by their stacked norm, weight decay) acts on the wrong object.
  So they carry a guard, a zero-size PRNG key: JAX refuses arithmetic on it
  while tracing, with an error whose dtype, ``key<...>``, says to put such
  a transform inside ``chain``, after the compressor. Array methods
  (``.mean``, ``.shape``) and ``np.asarray`` raise ``LocalGradsError``;
  combining them with another tree (a moment, the params) meets JAX's
  pytree structure error, which names ``LocalGrads``.

  Add up micro-batches' local gradients with ``+`` (or ``sum``), scale them
  with ``*`` and ``/``, and read the arrays from ``stacked``.

  Attributes:
    stacked: the gradients in the params' structure (for a Flax NNX module,
      an ``nnx.State`` of ``nnx.Param``), each leaf ``(num_devices, *shape)``
      and sharded over the device axes.
    guard: the key (an ``nnx.Param`` for a module, so that
      ``nnx.Optimizer(..., wrt=nnx.Param)`` hands it on to ``chain``).
  """

  def __init__(self, stacked: Any, guard: Any):
    self.stacked = stacked
    self.guard = guard

  def _map(self, f: Callable) -> "LocalGrads":
    return LocalGrads(jax.tree.map(f, self.stacked), self.guard)

  def __add__(self, other: Any) -> "LocalGrads":
    if not isinstance(other, LocalGrads):
      return NotImplemented
    return LocalGrads(
        jax.tree.map(jnp.add, self.stacked, other.stacked), self.guard
    )

  def __radd__(self, other: Any) -> "LocalGrads":
    if isinstance(other, int) and other == 0:  # sum() starts from 0
      return self
    return NotImplemented

  def __mul__(self, scale: Any) -> "LocalGrads":
    if isinstance(scale, LocalGrads):
      return NotImplemented
    return self._map(lambda g: g * scale)

  __rmul__ = __mul__

  def __truediv__(self, scale: Any) -> "LocalGrads":
    if isinstance(scale, LocalGrads):
      return NotImplemented
    return self._map(lambda g: g / scale)

  def __getattr__(self, name: str) -> Any:
    # Only for names that the instance lacks: an array's method or property
    # (.mean, .shape, .astype) is misuse; anything else is a plain typo.
    if not name.startswith("_") and hasattr(jax.Array, name):
      raise LocalGradsError(
          f"acp_jax.LocalGrads has no .{name}, being each device's"
          f" gradients, not an array: {_FIX}"
      )
    raise AttributeError(f"'LocalGrads' object has no attribute {name!r}")

  def __array__(self, *args, **kwargs):
    del args, kwargs
    raise LocalGradsError(
        "acp_jax.LocalGrads cannot become a numpy array, being each"
        f" device's gradients, not one array: {_FIX}"
    )

  def __repr__(self) -> str:
    return f"LocalGrads(stacked={self.stacked!r})"


jax.tree_util.register_pytree_with_keys(
    LocalGrads,
    lambda g: (
        (
            (jax.tree_util.GetAttrKey("stacked"), g.stacked),
            (jax.tree_util.GetAttrKey("guard"), g.guard),
        ),
        None,
    ),
    lambda _, children: LocalGrads(*children),
)


def _never(*args):
  del args
  raise TypeError("the guard of acp_jax.LocalGrads is not a random key")


# The guard's dtype is key<tag>: JAX prints it in the error of any operation
# on it, so the tag is the message to whoever placed a transform there.
_GUARD = jex_random.define_prng_impl(
    key_shape=(0,),
    seed=_never,
    split=_never,
    random_bits=_never,
    fold_in=_never,
    name="acp_jax.LocalGrads.guard",
    tag=f"acp_jax.LocalGrads, each device's gradients, not an array: {_FIX}",
)


def guard() -> jax.Array:
  return jax.random.wrap_key_data(jnp.zeros((0,), jnp.uint32), impl=_GUARD)


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _is_guard(x: Any) -> bool:
  return is_key(x) and jax.random.key_impl(x) == _GUARD


def stacked(updates: Any) -> Any:
  """The stacked arrays ``chain``'s update gets: of a ``LocalGrads``, or of
  the mapping of its fields that ``nnx.Optimizer`` hands on."""
  if isinstance(updates, LocalGrads):
    return updates.stacked
  fields = set(updates) if isinstance(updates, Mapping) else set()
  if fields == {"stacked", "guard"} and _is_guard(updates["guard"]):
    return updates["stacked"]
  if fields == {"stacked"}:
    raise TypeError(
        "nnx.Optimizer's wrt filter left out the guard of the local"
        " gradients (an nnx.Param at path 'guard'): add it to your"
        " filter, wrt=nnx.Any(<your filter>, nnx.PathContains('guard')),"
        " which keeps the params it leaves out frozen."
    )
  raise TypeError(
      "DataParallel.chain(tx) takes the local gradients of"
      f" DataParallel.value_and_grad (a LocalGrads), got"
      f" {type(updates).__name__}. Take the gradients from"
      " DataParallel.value_and_grad, not jax.grad or nnx.grad (whose"
      " gradient of the global loss is already the dense mean)."
  )


def value_and_grad(
    dp: Any,
    fun: Callable[..., Any],
    *,
    has_aux: bool,
    aux_specs: Any,
    batch_specs: Any,
) -> Callable[..., tuple[Any, LocalGrads]]:
  """``DataParallel.value_and_grad(fun, ...)`` of ``dp`` (see its docstring):
  a pytree's gradients, or an NNX module's ``nnx.Param`` gradients."""
  if aux_specs is None:
    aux_specs = dp.device_spec

  def run(loss_fn, params, rest, batch):
    specs = _specs.batch_specs(
        batch, batch_specs, dp.device_spec, dp.num_devices
    )
    _specs.check_explicit_placement(batch, specs, dp.mesh, dp.device_axes)
    return jax.shard_map(
        _local_value_and_grad(loss_fn, dp.device_axes, specs, aux_specs),
        mesh=dp.mesh,
        in_specs=(P(), P()) + specs,
        out_specs=((P(), aux_specs), dp.device_spec, P()),
        check_vma=False,
    )(params, rest, *batch)

  def grads_of(params, *batch):
    nnx = flax_nnx()
    if nnx is not None and isinstance(params, nnx.Module):
      value, grads = _module_value_and_grad(
          run, fun, has_aux, dp.device_axes, params, batch
      )
      grads_guard = nnx.Param(guard())
    else:
      value, grads, _ = run(_pure_loss(fun, has_aux), params, None, batch)
      grads_guard = guard()
    return (value if has_aux else value[0]), LocalGrads(grads, grads_guard)

  return grads_of


def _split_value(value: Any, has_aux: bool) -> tuple[Any, Any]:
  return value if has_aux else (value, ())


def _pure_loss(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """``fun(params, *batch)`` as ``loss_fn(params, rest, *batch)``, which
  returns ``(loss, (aux, rest))``; a pytree of params has no ``rest``."""

  def loss_fn(params, rest, *batch):
    loss, aux = _split_value(fun(params, *batch), has_aux)
    return loss, (aux, rest)

  return loss_fn


def _module_loss(
    fun: Callable[..., Any], has_aux: bool, graphdef: Any, axes: tuple
) -> Callable[..., Any]:
  """``fun(model, *batch)`` as ``loss_fn(params, rest, *batch)`` on the
  module's arrays, returning its non-parameter state as it leaves ``fun``."""
  nnx = flax_nnx()

  def loss_fn(params, rest, *batch):
    model = nnx.merge(graphdef, params, rest)
    loss, aux = _split_value(fun(model, *batch), has_aux)
    rest = nnx.as_pure(nnx.split(model, nnx.Param, ...)[2])
    # Non-parameter state (BatchNorm statistics) is averaged so that the
    # replicas stay identical; integers (RNG counters) agree already.
    rest = jax.tree.map(
        lambda x: lax.pmean(x, axes)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else x,
        rest,
    )
    return loss, (aux, rest)

  return loss_fn


def _module_value_and_grad(
    run: Callable[..., Any],
    fun: Callable[..., Any],
    has_aux: bool,
    axes: tuple,
    model: Any,
    batch: tuple,
) -> tuple[Any, Any]:
  """``run`` on an NNX module: its value and its ``nnx.Param`` gradients;
  the module takes its new non-parameter state."""
  nnx = flax_nnx()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  # Only arrays cross into shard_map: NNX variables may not be mutated
  # from another trace level. The gradients get their Param type back
  # so that nnx.Optimizer's filter finds them, and so does the guard.
  value, grads, rest = run(
      _module_loss(fun, has_aux, graphdef, axes),
      nnx.as_pure(params),
      nnx.as_pure(rest),
      batch,
  )
  nnx.update(model, rest)
  grads = jax.tree.map(
      lambda v, g: v.replace(g),
      params,
      grads,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
  )
  return value, grads


def _local_value_and_grad(
    loss_fn: Callable[..., Any], axes: tuple, specs: tuple, aux_specs: Any
) -> Callable[..., Any]:
  """One device's step under ``shard_map``: the mean loss, and its shard's
  gradients (and per-device ``aux``) on a leading axis of one to stack."""

  def local(params, rest, *batch):
    # A key that every device receives alike would draw the same
    # randomness on every shard; the model keeps the unfolded one.
    fold = _folding_device_index(axes)
    batch = tuple(
        jax.tree.map(
            lambda x, spec: fold(x) if _specs.is_replicated(spec) else x,
            arg,
            arg_specs,
        )
        for arg, arg_specs in zip(batch, specs)
    )
    (loss, (aux, new_rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, jax.tree.map(fold, rest), *batch
    )
    new_rest = jax.tree.map(
        lambda old, new: old if is_key(old) else new, rest, new_rest
    )
    stack = lambda t: jax.tree.map(lambda x: x[None], t)
    aux = jax.tree.map(
        lambda spec, a: a if spec == P() else stack(a),
        aux_specs,
        aux,
        is_leaf=_specs.is_spec,
    )
    return (lax.pmean(loss, axes), aux), stack(grads), new_rest

  return local


def check_stacked(grads: Any, params: Any, num_devices: int) -> None:
  """Raises unless each leaf of ``grads`` is its param's gradients of
  ``num_devices`` devices, stacked."""
  n = num_devices
  for (path, g), p in zip(
      jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params)
  ):
    if tuple(g.shape) != (n,) + tuple(p.shape):
      raise ValueError(
          f"gradient {jax.tree_util.keystr(path)} has shape {g.shape}, but"
          f" a parameter of shape {p.shape} needs its {n} devices' local"
          f" gradients stacked, shape {(n,) + tuple(p.shape)}. Take the"
          " gradients from DataParallel.value_and_grad, not jax.grad or"
          " nnx.grad (whose gradient of the global loss is already the"
          " dense mean)."
      )


def _folding_device_index(axes: tuple[str, ...]) -> Callable[[Any], Any]:
  """Folds this device's index over ``axes`` into a PRNG key (under
  ``shard_map``); other values pass unchanged."""
  index = lax.axis_index(axes)
  return lambda x: jax.random.fold_in(x, index) if is_key(x) else x
