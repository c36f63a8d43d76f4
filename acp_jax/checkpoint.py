"""Verified orbax checkpoints of states that hold a compressor, phase included.

``save`` records a checksum of every array (computed on the devices, so it
works across processes), the compressor's factory and arguments and the
types of the state's containers; ``restore`` refuses a checkpoint of another
state, optimizer or compressor before any array is read, and raises
``DamagedError`` for one that is not as saved. The low-rank compressors
record their phase in an array's shape (``acp_jax.phase``), so ``restore``
takes that shape from the checkpoint, not from the fresh state.

Needs ``orbax-checkpoint`` (``pip install acp_jax[checkpoint]``). The other
public names are the pieces of ``save`` and ``restore``, for checkpointers
of one's own.
"""

from collections.abc import Mapping
import os
import pathlib
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import orbax.checkpoint as ocp

from acp_jax import _checkpoint_record
from acp_jax import _local_grads
from acp_jax import phase as phase_lib
from acp_jax import registry
from acp_jax._checkpoint_record import checksums
from acp_jax._checkpoint_record import compressor_record
from acp_jax._checkpoint_record import current_record
from acp_jax._checkpoint_record import DamagedError
from acp_jax._checkpoint_record import describe_read_error
from acp_jax._checkpoint_record import differences
from acp_jax._checkpoint_record import log_abandoned_reads
from acp_jax._checkpoint_record import sealed
from acp_jax._checkpoint_record import unsealed
from acp_jax._checkpoint_record import verify
from acp_jax.data_parallel import DataParallelState

__all__ = [
    "DamagedError",
    "checksums",
    "compressor_record",
    "current_record",
    "describe_read_error",
    "differences",
    "layout",
    "log_abandoned_reads",
    "read",
    "restore",
    "save",
    "sealed",
    "target",
    "unsealed",
    "verify",
]

# The key of this module's record in an orbax checkpoint's custom metadata.
_RECORD = "acp_jax"

# What orbax appends to a checkpoint's path while its save is under way.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _compressor_states() -> tuple[type, ...]:
  """The states only their compressor, arguments included, can continue."""
  return (DataParallelState, *registry.state_types())

# ``save``'s compressor when none is passed: distinct from None, which saves
# a compressor's state without its record on purpose.
_MISSING = object()


def layout(tree: Any) -> dict[str, list]:
  """``{name: [dtype, shape]}`` of each array of ``tree``, by orbax's
  dotted name: what a restore target must match."""
  return {
      name: [str(x.dtype), list(x.shape)]
      for name, (_, x) in _by_name(tree).items()
  }


def _structure(tree: Any) -> dict[str, str]:
  """``{path: "type of n"}`` of each container in ``tree``: what tells an
  ``optax.adam`` state from an ``optax.adamw`` one, whose arrays match."""
  nodes = {}

  def visit(path, node):
    treedef = jax.tree.structure(node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
      return
    children = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )[0]
    nodes[jax.tree_util.keystr(path)] = (
        f"{type(node).__name__} of {len(children)}"
    )
    for key, child in children:
      visit(path + key, child)

  visit((), tree)
  return nodes


def _compressor_paths(tree: Any) -> list[str]:
  """The paths in ``tree`` of the compressors' states. Under ``nnx.state``,
  which keeps an optimizer state's fields but not its type, such a state is
  a mapping of ``nnx.OptState`` leaves keyed by its type's fields."""
  types = _compressor_states()
  fields = {frozenset(t._fields): t for t in types}

  def state_type(x):
    if isinstance(x, types):
      return type(x)
    if isinstance(x, Mapping) and frozenset(x) in fields:
      if _holds_optimizer_state(x, every=True):
        return fields[frozenset(x)]
    return None

  found = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: state_type(x) is not None
  )[0]
  paths = []
  for path, x in found:
    kind = state_type(x)
    if kind is DataParallelState:
      path += (
          (jax.tree_util.GetAttrKey("comm"),)
          if isinstance(x, DataParallelState)
          else (jax.tree_util.DictKey("comm"),)
      )
    if kind is not None:
      paths.append(jax.tree_util.keystr(path))
  return paths


def _holds_optimizer_state(tree: Any, every: bool = False) -> bool:
  """Whether ``tree`` holds an NNX optimizer's state, typeless under
  ``nnx.state`` and so maybe a compressor's (``every``: nothing else)."""
  nnx = _local_grads.flax_nnx()
  if nnx is None:
    return False
  leaves = jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.OptState)
  )
  held = [isinstance(x, nnx.OptState) for x in leaves]
  return bool(held) and (all(held) if every else any(held))


def _is_fresh(path: Any, fresh: tuple[str, ...]) -> bool:
  name = jax.tree_util.keystr(path)
  return any(
      name == p or (name.startswith(p) and name[len(p)] in ".[")
      for p in fresh
  )


def _is_phase(path, dtype: str, shape: tuple[int, ...]) -> bool:
  """Whether an array at ``path`` is a low-rank phase marker: the one array
  whose shape may differ between a checkpoint and the live state."""
  names = [_key_name(k) for k in path]
  if names and names[-1] == "value":  # inside an NNX Variable
    names.pop()
  return (
      bool(names)
      and names[-1] == "phase"
      and phase_lib.is_marker(dtype, shape)
  )


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _by_name(tree: Any) -> dict[str, tuple[Any, Any]]:
  """{dotted path (orbax's naming): (path, leaf)} of the array leaves."""
  return {
      ".".join(_key_name(k) for k in path): (path, leaf)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
      if leaf is not None
  }


def _saved_arrays(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """``{name: (dtype, shape)}`` from the orbax metadata at ``directory``."""
  try:
    # The handler's, not the checkpointer's: that one also reads a step's
    # metadata file, which the directory of one item lacks, and warns.
    handler = ocp.StandardCheckpointHandler()
    tree = handler.metadata(pathlib.Path(os.path.abspath(directory))).tree
  except Exception as e:  # pylint: disable=broad-except
    raise DamagedError(
        directory, f"its metadata cannot be read: {describe_read_error(e)}"
    ) from None
  return {
      name: (str(m.dtype), tuple(m.shape))
      for name, (_, m) in _by_name(tree).items()
  }


def _shapes(
    directory: Any,
    saved: dict[str, tuple[str, tuple[int, ...]]],
    live: dict[str, tuple[Any, Any]],
    fresh: tuple[str, ...] = (),
    compressors: tuple[str, ...] = (),
) -> dict[str, tuple[str, tuple[int, ...]]]:
  """The dtype and shape to restore of each live array: its own, or the
  saved one of a phase marker or a ``fresh`` array; raises ``ValueError``
  naming what differs, saved and now."""
  missing = sorted(set(live) - set(saved))
  extra = sorted(set(saved) - set(live))
  if missing or extra:
    raise ValueError(
        f"the checkpoint at {directory} was saved from another state: arrays"
        f" only in the live state: {missing or 'none'}; only in the"
        f" checkpoint: {extra or 'none'}"
    )
  shapes = {}
  for name, (path, x) in live.items():
    dtype, shape = saved[name]
    now = (str(x.dtype), tuple(x.shape))
    if (dtype, shape) == now or _is_fresh(path, fresh):
      shapes[name] = (dtype, shape)
    elif _is_phase(path, *now) and _is_phase(path, dtype, shape):
      shapes[name] = (dtype, shape)
    else:
      shown = (
          f"{jax.tree_util.keystr(path)}: saved {dtype}{list(shape)} in"
          f" {directory}, now {now[0]}{list(now[1])}"
      )
      under = [p for p in compressors if _is_fresh(path, (p,))]
      if under and dtype == now[0] and shape[1:] == now[1][1:]:
        raise ValueError(
            f"{shown}: the compressor's state was saved on {shape[0]}"
            f" devices and this run has {now[1][0]}. Restore the rest and"
            " start the compressor's state afresh, as like holds it:"
            f" restore(directory, like, compressor=..., fresh=[{under[0]!r}])"
        )
      raise ValueError(
          f"{shown}; the checkpoint comes from another model, optimizer or"
          " compressor setting or device count"
      )
  return shapes


def target(
    directory: str,
    like: Any,
    *,
    saved: Any = None,
    fresh: tuple[str, ...] = (),
) -> Any:
  """The abstract restore target for the checkpoint at ``directory``.

  Args:
    directory: a checkpoint of ``save`` or orbax's ``StandardSave`` (under a
      ``CheckpointManager``, the item's directory, e.g. ``root/STEP/state``).
    like: the live state (arrays or ``jax.ShapeDtypeStruct``), whose
      structure, shapes, dtypes and shardings the restore produces, but for
      phase markers' shapes, taken from the checkpoint.
    saved: the ``layout`` of the saved state, from a verified record, to
      check ``like`` and orbax's metadata against.
    fresh: paths in ``like`` (``jax.tree_util.keystr``'s, e.g.
      ``"[1].comm"``) whose arrays are read as saved, whatever their shape,
      replicated on ``like``'s mesh.

  Returns:
    ``like`` with ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    ValueError: if an array of ``like`` is missing, extra, or differs in
      shape or dtype (saved and now named).
    DamagedError: if its metadata cannot be read, or differs from ``saved``.
  """
  if isinstance(fresh, str):
    raise TypeError(
        f"fresh must be a list of paths, got the string {fresh!r}: pass"
        f" fresh=[{fresh!r}]"
    )
  fresh = tuple(fresh)
  live = _by_name(like)
  compressors = tuple(_compressor_paths(like))
  for p in fresh:
    if not any(_is_fresh(path, (p,)) for path, _ in live.values()):
      raise ValueError(
          f"fresh={list(fresh)!r}: no array of like lies under {p!r}; the"
          " compressors' states of like are at"
          f" {list(compressors) or 'none of its paths'}"
      )
  if saved is not None:
    _shapes(
        directory,
        {name: (dtype, tuple(shape)) for name, (dtype, shape) in saved.items()},
        live,
        fresh,
        compressors,
    )
  try:
    shapes = _shapes(
        directory, _saved_arrays(directory), live, fresh, compressors
    )
  except ValueError as e:
    if saved is None:
      raise
    raise DamagedError(
        directory, f"its metadata differs from its record: {e}"
    ) from None
  # Values that live on a single device (uncommitted ones: fresh counters,
  # a model never placed) come back replicated on the state's mesh.
  meshes = {
      x.sharding.mesh
      for _, x in live.values()
      if isinstance(getattr(x, "sharding", None), NamedSharding)
  }
  fallback = NamedSharding(meshes.pop(), P()) if len(meshes) == 1 else None
  leaves = []
  for name, (path, x) in live.items():
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) and fallback is not None:
      sharding = fallback
    dtype, shape = shapes[name]
    dtype = x.dtype if dtype == str(x.dtype) else jnp.dtype(dtype)
    if _is_fresh(path, fresh) and isinstance(sharding, NamedSharding):
      # Read only to be verified; its saved shape may not divide the mesh.
      sharding = NamedSharding(sharding.mesh, P())
    leaves.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def read(directory: Any, restore: Any) -> Any:
  """``restore()``, an orbax read of ``directory``, any failure raised as one
  ``DamagedError`` line naming the path and array, not TensorStore's spec."""
  try:
    return restore()
  except Exception as e:  # pylint: disable=broad-except
    raise DamagedError(
        directory, f"its arrays cannot be read: {describe_read_error(e)}"
    ) from None


def save(
    directory: str, state: Any, *, compressor: Any = _MISSING
) -> None:
  """Writes ``state`` to ``directory`` (a new path) with a checksum of every
  array, the types of its containers and the compressor's factory and
  arguments; atomically: an interrupted save leaves no checkpoint.

  Args:
    directory: where the checkpoint goes; it must not exist.
    state: a pytree of arrays (e.g. ``(params, tx.init(params))`` or
      ``nnx.state((model, optimizer))``).
    compressor: the compressor the state is for (e.g.
      ``DataParallel.compressor``), recorded so that ``restore`` refuses
      another. Required when ``state`` holds a compressor's state (or an
      NNX optimizer's, which may be one); None saves it unchecked.

  Raises:
    ValueError: if ``state`` holds a compressor's state but no ``compressor``.
  """
  if compressor is _MISSING:
    paths = _compressor_paths(state)
    if paths:
      holds = f"a compressor's state at {paths[0]}"
    elif _holds_optimizer_state(state):
      holds = "an nnx.Optimizer's state, which may be a compressor's"
    else:
      holds = None
    if holds is not None:
      raise ValueError(
          "compressor= is missing: pass the compressor the state is for,"
          " save(directory, state, compressor=dp.compressor), so that"
          " restore refuses any other (or compressor=None to save it"
          f" unchecked); the state holds {holds}"
      )
    compressor = None
  record = {
      "checksums": checksums(state),
      "layout": layout(state),
      "structure": _structure(state),
      "compressor": (
          None if compressor is None else compressor_record(compressor)
      ),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(
        os.path.abspath(directory),
        state,
        custom_metadata={_RECORD: sealed(record)},
    )
    checkpointer.wait_until_finished()


def _no_checkpoint(directory: str) -> str | None:
  """Why ``directory`` holds no completed checkpoint, with the fix; or None."""
  path = os.path.abspath(directory)
  parent, name = os.path.split(path)
  partial = sorted(
      f
      for f in (os.listdir(parent) if os.path.isdir(parent) else ())
      if f.startswith(name + _TMP_SUFFIX)
  )
  if partial:
    return (
        f"no checkpoint at {directory}: its save did not complete (orbax left"
        f" {partial[0]} beside it, which is never restored); restore the"
        " checkpoint saved before it, or save this one again"
    )
  if not os.path.exists(path):
    return (
        f"no checkpoint at {directory}: the path does not exist; pass the"
        " directory that acp_jax.checkpoint.save wrote"
    )
  return None


def _record(directory: str) -> dict[str, Any]:
  missing = _no_checkpoint(directory)
  if missing is not None:
    raise FileNotFoundError(missing)
  try:
    metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(directory))
    custom = metadata.custom_metadata or {}
  except Exception as e:  # pylint: disable=broad-except
    raise DamagedError(
        directory, f"its metadata cannot be read: {describe_read_error(e)}"
    ) from None
  if metadata.item_metadata is None:
    raise FileNotFoundError(
        f"no checkpoint at {directory}: the directory holds no orbax"
        " checkpoint (a save interrupted before it completed, or another"
        " directory); pass the directory that acp_jax.checkpoint.save wrote"
    )
  if _RECORD not in custom:
    raise ValueError(
        f"{directory} was written by orbax, not by acp_jax.checkpoint.save"
        " (it holds no checksums): restore it with orbax, its target from"
        " acp_jax.checkpoint.target(directory, like)"
    )
  return unsealed(custom[_RECORD], directory)


def _check_structure(directory: str, saved: Any, like: Any) -> None:
  """Raises ``ValueError`` naming the containers of ``like`` that differ
  from ``saved`` (a ``_structure`` kept with the checkpoint)."""
  if saved is None:  # saved before the record held it
    return
  differ = differences(saved, _structure(like))
  if differ:
    raise ValueError(
        f"the checkpoint at {directory} holds a state of another structure,"
        " an optimizer's or compressor's state of other parts (e.g. optax.adam"
        " saved, optax.adamw now): build like with the optimizer it was saved"
        " with;"
        f" {'; '.join(differ[:3])}{'; ...' if len(differ) > 3 else ''}"
    )


def restore(
    directory: str,
    like: Any,
    *,
    compressor: Any = None,
    fresh: tuple[str, ...] = (),
) -> Any:
  """The state saved at ``directory``, laid out like ``like``, verified.

  ``like`` is typically a fresh state (``tx.init(params)``,
  ``nnx.state(optimizer)``); a Q-phase checkpoint comes back in phase Q.

  Onto another number of devices, the params and the optimizer's state are
  restored and the compressor's starts afresh (its residuals are one per
  device)::

    state = checkpoint.restore(
        path, (params, tx.init(params)), compressor=dp.compressor,
        fresh=["[1].comm"],
    )

  Args:
    directory: a checkpoint written by ``save``.
    like: the live state.
    compressor: the compressor the state is for, when ``save`` was given
      one: another factory, or the same with any other argument, is refused.
    fresh: paths in ``like`` (``jax.tree_util.keystr``'s) whose arrays are
      returned as ``like`` holds them: read and verified, but not restored.

  Raises:
    FileNotFoundError: if ``directory`` holds no completed checkpoint.
    ValueError: if the state or the compressor differs from the saved one
      (both named); nothing is then read.
    DamagedError: if the checkpoint is not as saved (path and array named).
  """
  directory = str(directory)
  record = _record(directory)
  _checkpoint_record.check_compressor(
      directory, record["compressor"], compressor
  )
  abstract = target(directory, like, saved=record["layout"], fresh=fresh)
  _check_structure(directory, record.get("structure"), like)
  with ocp.StandardCheckpointer() as checkpointer:
    state = read(
        directory,
        lambda: checkpointer.restore(os.path.abspath(directory), abstract),
    )
  verify(state, record["checksums"], directory)
  if not fresh:
    return state
  return jax.tree_util.tree_map_with_path(
      lambda path, x, now: now if _is_fresh(path, tuple(fresh)) else x,
      state,
      like,
  )
