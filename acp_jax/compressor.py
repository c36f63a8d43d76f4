"""What every compressor shares: its type, its accounting and its checks."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from acp_jax import collectives


class CommVolume(NamedTuple):
  """Bytes that one step moves, per device.

  Attributes:
    all_reduce: size of the buffers each device contributes to all-reduces.
    all_gather: bytes each device receives from all-gathers (the axis size
      times what it contributes, its own part included), which is the size of
      the gathered result.
  """

  all_reduce: int = 0
  all_gather: int = 0

  @property
  def total(self) -> int:
    return self.all_reduce + self.all_gather


# (params or their shapes, axis size) -> {phase name: CommVolume}.
VolumeFn = Callable[[Any, int], dict[str, CommVolume]]


class Compressor(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that knows what it communicates.

  It is a plain ``GradientTransformation`` to optax (``optax.chain`` and
  friends take it as is); ``comm_bytes`` reads the extra accounting.
  """

  def __new__(cls, init, update, volume: VolumeFn):
    self = super().__new__(cls, init, update)
    self._volume = volume
    return self


def comm_bytes(
    compressor: Compressor, params: Any, *, num_devices: int
) -> dict[str, CommVolume]:
  """Bytes one step of ``compressor`` sends per device, by phase.

  Args:
    compressor: a transform made by one of this package's factories (not a
      chain holding it).
    params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` like them.
    num_devices: size of the data-parallel axis.

  Returns:
    ``{"step": CommVolume}`` for single-phase methods; ``{"p": ..., "q": ...}``
    for ACP-SGD, whose P-steps and Q-steps send different factors.
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(
        "comm_bytes needs a compressor made by an acp_jax factory, got"
        f" {type(compressor).__name__}; pass the compressor itself, not an"
        " optax.chain holding it."
    )
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
  return compressor._volume(params, num_devices)


def check_float_leaves(params: Any, caller: str) -> None:
  """Raises if a leaf is not a real floating-point array."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{caller}: leaf {jax.tree_util.keystr(path)} has dtype {dtype};"
          " only real floating-point parameters can be compressed."
      )


def is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def state_leaves(state_tree: Any) -> list[Any]:
  """Leaves of a state tree that mirrors the params, one per param: an array,
  or ``optax.MaskedNode`` where that param keeps no state."""
  return jax.tree.leaves(state_tree, is_leaf=is_masked)


def check_tree_matches(grads: Any, state_tree: Any, caller: str) -> None:
  """Raises unless ``grads`` has the structure and shapes of ``state_tree``,
  a tree that mirrors the params the state was initialized from."""
  state_def = jax.tree.structure(state_tree, is_leaf=is_masked)
  grads_def = jax.tree.structure(grads)
  if state_def != grads_def:
    raise ValueError(
        f"{caller}: the gradient tree {grads_def} does not match the tree the"
        f" state was initialized with, {state_def}."
    )
  pairs = zip(
      jax.tree_util.tree_leaves_with_path(grads), state_leaves(state_tree)
  )
  for (path, g), s in pairs:
    if not is_masked(s) and s.shape != g.shape:
      raise ValueError(
          f"{caller}: gradient {jax.tree_util.keystr(path)} has shape"
          f" {g.shape}, but the state was initialized for {s.shape}."
      )


# A tree of bools like the params (True: keep that leaf dense), or a function
# of the params (or gradients) returning one, as in optax.masked.
KeepDense = Any | Callable[[Any], Any] | None


def keep_dense_leaves(keep_dense: KeepDense, tree: Any) -> list[bool]:
  """The ``keep_dense`` mask resolved against ``tree``, as a flat list."""
  n = len(jax.tree.leaves(tree))
  if keep_dense is None:
    return [False] * n
  mask = keep_dense(tree) if callable(keep_dense) else keep_dense
  if jax.tree.structure(mask) != jax.tree.structure(tree):
    raise ValueError(
        f"keep_dense must give a tree of bools like the params"
        f" {jax.tree.structure(tree)}, got {jax.tree.structure(mask)}"
    )
  return [bool(m) for m in jax.tree.leaves(mask)]


def _varying_axes(x) -> frozenset | None:
  """Mapped axes over which ``x`` may differ, if JAX tracks them here."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return aval.manual_axis_type.varying
  return getattr(aval, "vma", None)


def check_local(grads: Any, axis_name: str, caller: str) -> None:
  """Raises if every gradient is provably identical across ``axis_name``.

  Under ``jax.shard_map`` (check_vma=True), ``jax.grad`` with respect to
  replicated params all-reduces the gradient densely by itself, and the
  compressor would then add its own traffic on top of a full S-SGD step.
  Only checkable where JAX tracks varying axes (not under ``jax.pmap`` or
  ``check_vma=False``, where gradients are local anyway).
  """
  if axis_name not in (_varying_axes(lax.axis_index(axis_name)) or ()):
    return
  leaves = jax.tree.leaves(grads)
  if leaves and not any(axis_name in _varying_axes(g) for g in leaves):
    raise ValueError(
        f"{caller}: the gradients are already identical across axis"
        f" {axis_name!r}, so jax.grad all-reduced them densely before the"
        " compressor saw them (it does so for params replicated under"
        " jax.shard_map). Differentiate with respect to"
        f" jax.lax.pcast(params, {axis_name!r}, to='varying') so each device"
        " hands over its own gradient."
    )


def begin_update(grads: Any, axis_name: str, caller: str) -> int:
  """Checks where an update runs and what it is given; returns the axis size."""
  n = collectives.axis_size(axis_name, caller)
  check_local(grads, axis_name, caller)
  return n
