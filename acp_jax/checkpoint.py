"""Verified orbax checkpoints of states that hold a compressor, phase included.

``save`` writes the state through orbax with a record in the checkpoint's
own metadata: a checksum of every array (computed on the devices, so it
works across processes), the compressor's factory and arguments (a state
that holds a compressor's state is not saved without them), the types of
the state's containers, and a digest of the record itself. ``restore``
refuses a checkpoint of another state, optimizer or compressor, naming
saved and now, before any array is read, and raises ``DamagedError``
(naming the path and the array) if a file cannot be read or an array or
the record no longer matches its checksum.

The low-rank compressors record their phase in the shape of a small array
(``acp_jax.phase``), so a restore into a freshly initialized state, which
is always in its first phase, would ask orbax for the wrong shape.
``restore`` takes the phase from the checkpoint instead and checks every
other array against the live state.

Needs ``orbax-checkpoint`` (``pip install acp_jax[checkpoint]``).

One module on purpose: the checksums, the record and the phase-aware
target are the parts of one verified save and restore, and its reference
page lists them together for checkpointers of one's own.
"""

from collections.abc import Mapping
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import orbax.checkpoint as ocp

from acp_jax import _local_grads
from acp_jax import compressor as compressor_lib
from acp_jax import phase as phase_lib
from acp_jax import registry
from acp_jax.data_parallel import DataParallelState

# The key of this module's record in an orbax checkpoint's custom metadata.
_RECORD = "acp_jax"

# What orbax appends to a checkpoint's path while its save is under way.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _compressor_states() -> tuple[type, ...]:
  """The states that only their compressor, arguments included, can
  continue: each registered compressor's, and ``DataParallel``'s."""
  return (DataParallelState, *registry.state_types())

# ``save``'s compressor when none is passed: distinct from None, which saves
# a compressor's state without its record on purpose.
_MISSING = object()


class DamagedError(Exception):
  """A checkpoint that is not as it was saved: a file cannot be read, or an
  array or the record differs from its checksum.

  Attributes:
    path: the checkpoint's directory.
    reason: what is wrong, naming the array where one is.
  """

  def __init__(self, path: Any, reason: str):
    super().__init__(f"{path}: {reason}")
    self.path = path
    self.reason = reason


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 in which every input bit
  flips each output bit with probability about 1/2."""
  h ^= h >> 16
  h *= jnp.uint32(0x85EBCA6B)
  h ^= h >> 13
  h *= jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _checksum(x: jax.Array) -> jax.Array:
  """A uint32 checksum of ``x``'s bits: sum over elements of
  fmix32(word ^ fmix32(flat index)), modulo 2**32.

  Each term is a bijection of its word, so changing any one element always
  changes the sum; changing several, or moving an element, leaves it
  unchanged with probability about 2**-32. The flat index comes from iotas
  rather than a reshape, so a sharded array is summed where it lies and only
  the partial sums travel.
  """
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    # 8-byte elements become two words along a new last axis.
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  index = jnp.zeros(words.shape, jnp.uint32)
  for axis, size in enumerate(words.shape):
    index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(
        jnp.uint32, words.shape, axis
    )
  return jnp.sum(_fmix32(words ^ _fmix32(index)), dtype=jnp.uint32)


@jax.jit
def _checksum_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_checksum(x) for x in leaves]


def checksums(tree: Any) -> dict[str, int]:
  """A checksum of each array of ``tree``, keyed by its path.

  Computed on the arrays' devices in one compiled call; each checksum is a
  replicated scalar, so every process of a multi-process run gets the same
  values without any array being gathered.

  Args:
    tree: a pytree of ``jax.Array`` (sharded or not, addressable or not).

  Returns:
    ``{jax.tree_util.keystr(path): checksum}`` with checksums in
    ``[0, 2**32)``: equal for equal arrays, different with probability
    about ``1 - 2**-32`` when any byte differs or elements trade places.
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_checksum_leaves([x for _, x in leaves]))
  return {
      jax.tree_util.keystr(path): int(s)
      for (path, _), s in zip(leaves, sums)
  }


def layout(tree: Any) -> dict[str, list]:
  """``{name: [dtype, shape]}`` of each array of ``tree``, by orbax's
  dotted name: what a restore target must match."""
  return {
      name: [str(x.dtype), list(x.shape)]
      for name, (_, x) in _by_name(tree).items()
  }


def _structure(tree: Any) -> dict[str, str]:
  """``{path: "type of n"}`` of each container in ``tree`` (a tuple, a dict,
  an optimizer's state): what tells an ``optax.adam`` state from an
  ``optax.adamw`` one, whose arrays are the same."""
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
  """The paths in ``tree`` of the compressors' states: what only the same
  compressor, with the same arguments, can continue. Under ``nnx.state``,
  where an optimizer's state keeps its fields but not its types, a state is
  a mapping of ``nnx.OptState`` leaves with its type's fields as keys."""
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
  """Whether ``tree`` holds an NNX optimizer's state (``every``: holds
  nothing else), which ``nnx.state`` keeps without its types, a
  compressor's as any other."""
  nnx = _local_grads.flax_nnx()
  if nnx is None:
    return False
  leaves = jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.OptState)
  )
  held = [isinstance(x, nnx.OptState) for x in leaves]
  return bool(held) and (all(held) if every else any(held))


def _is_fresh(path: Any, fresh: tuple[str, ...]) -> bool:
  """Whether the array at ``path`` lies under one of the paths ``fresh``."""
  name = jax.tree_util.keystr(path)
  return any(
      name == p or (name.startswith(p) and name[len(p)] in ".[")
      for p in fresh
  )


def _digest(record: dict[str, Any]) -> str:
  text = json.dumps(record, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def sealed(record: dict[str, Any]) -> dict[str, Any]:
  """``record`` (JSON-serializable) with a digest of itself added, so that
  a changed byte anywhere in it (a step, a setting, a checksum) is caught
  by ``unsealed``."""
  if "digest" in record:
    raise ValueError("record must not hold 'digest': sealed adds it")
  record = json.loads(json.dumps(record))
  return {**record, "digest": _digest(record)}


def unsealed(record: Any, path: Any) -> dict[str, Any]:
  """A record written by ``sealed``, without its digest.

  Raises:
    DamagedError: if it is not a dict with a digest that matches.
  """
  if not isinstance(record, dict) or "digest" not in record:
    raise DamagedError(path, "its record lacks its digest")
  rest = {k: v for k, v in record.items() if k != "digest"}
  if _digest(rest) != record["digest"]:
    raise DamagedError(path, "its record differs from its digest")
  return rest


def verify(state: Any, saved: dict[str, int], path: Any) -> None:
  """Raises ``DamagedError`` naming the arrays of ``state`` whose checksums
  differ from ``saved`` (a ``checksums`` result kept with the checkpoint).
  Collective: call it on every process alike."""
  now = checksums(state)
  differ = sorted(
      k for k in set(now) | set(saved) if now.get(k) != saved.get(k)
  )
  if differ:
    raise DamagedError(
        path,
        f"checksums differ for {len(differ)} of {len(saved)} arrays:"
        f" {', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}",
    )


def describe_read_error(error: BaseException) -> str:
  """One line for an orbax read that failed: the array whose file failed
  (from TensorStore's key, where it names one) and the first line of the
  error at the root of ``error``'s chain."""
  messages = []
  while error is not None:
    messages.append(str(error))
    root, error = error, error.__cause__ or error.__context__
  text = "\n".join(messages)
  found = re.search(r'Error reading "([^"]+)/[^"/]*"', text) or re.search(
      r"'path': '([^/'][^']*)/'", text
  )
  where = f"array {found.group(1)}: " if found else ""
  return f"{where}{type(root).__name__}: {str(root).partition(chr(10))[0]}"


def compressor_record(compressor: Any) -> dict[str, Any]:
  """``{"name": factory, "args": {argument: value}}`` of a compressor made
  by one of this package's factories, as a checkpoint records it."""
  made_by = getattr(compressor, "made_by", None)
  if made_by is None:
    raise TypeError(
        "compressor must be made by an acp_jax factory (e.g."
        f" DataParallel.compressor), got {type(compressor).__name__}; save"
        " a custom compressor's state unchecked with compressor=None"
    )
  name, args = made_by
  return {"name": name, "args": compressor_lib.plain_setting(args)}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts as ``{"a.b": leaf}``; empty dicts add nothing."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
  return flat


def differences(saved: Any, now: Any, now_is: str = "now") -> list[str]:
  """``key=SAVED, now NOW`` for each key of two nested dicts that differs
  (a missing one shown as none); ``now_is`` replaces "now"."""
  saved, now = _flatten(saved), _flatten(now)

  def show(flat, key):
    return repr(flat[key]) if key in flat else "none"

  return [
      f"{key}={show(saved, key)}, {now_is} {show(now, key)}"
      for key in sorted(set(saved) | set(now))
      if key not in saved or key not in now or saved[key] != now[key]
  ]


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
  """The dtype and shape to restore of each live array: its own, or a phase
  marker's or a ``fresh`` array's saved one. Raises ``ValueError`` naming
  missing and extra arrays, or the first that differs in shape or dtype,
  saved and now (and, for a compressor's state at ``compressors`` saved on
  another number of devices, the call that restores the rest)."""
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
    directory: a checkpoint written by ``save`` (or orbax's
      ``StandardSave``; with a ``CheckpointManager``, the item's directory,
      e.g. ``root/STEP/state``).
    like: the live state (arrays or ``jax.ShapeDtypeStruct``): its structure,
      shapes, dtypes and shardings are what the restore produces, except
      phase markers, whose shape comes from the checkpoint.
    saved: the ``layout`` of the saved state, from a verified record: then
      a difference from ``like`` is a ``ValueError``, and orbax's metadata
      differing from it a ``DamagedError``.
    fresh: paths in ``like`` (``jax.tree_util.keystr``'s, e.g.
      ``"[1].comm"``) whose arrays are read as saved, whatever their shape,
      replicated on ``like``'s mesh (``restore`` replaces them by ``like``'s).

  Returns:
    ``like`` with ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    ValueError: if the checkpoint lacks an array of ``like``, holds another,
      or one differs in shape or dtype (saved and now both named).
    DamagedError: if its metadata cannot be read (or differs from
      ``saved``).
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
  """``restore()``, an orbax read of the checkpoint at ``directory``, with
  any failure raised as one ``DamagedError`` line naming the path and the
  array, not TensorStore's spec."""
  try:
    return restore()
  except Exception as e:  # pylint: disable=broad-except
    raise DamagedError(
        directory, f"its arrays cannot be read: {describe_read_error(e)}"
    ) from None


def save(
    directory: str, state: Any, *, compressor: Any = _MISSING
) -> None:
  """Writes ``state`` to ``directory`` (a new path), atomically, with a
  checksum of every array, the types of its containers and the compressor's
  factory and arguments.

  Orbax writes to a temporary directory and renames it when complete, so an
  interrupted save leaves no checkpoint rather than a partial one.

  Args:
    directory: where the checkpoint goes; it must not exist.
    state: a pytree of arrays (e.g. ``(params, tx.init(params))`` or
      ``nnx.state((model, optimizer))``).
    compressor: the compressor the state is for (e.g.
      ``DataParallel.compressor``), recorded so that ``restore`` refuses
      another one. Required when ``state`` holds a compressor's state (or an
      NNX optimizer's, which may be one); None saves it unchecked.

  Raises:
    ValueError: if ``state`` holds a compressor's state and ``compressor`` is
      not given.
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
  """Why ``directory`` holds no completed checkpoint, with the fix, or None
  if it holds one."""
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


# Factory arguments that older versions recorded and this one no longer has,
# each with the test, of the value and the factory's name, that the value
# left the compressor as it is today.
_RETIRED = {
    # DeMo-style decay of the residual; 1 (or "none" in older records) kept
    # it whole, as every low-rank compressor now does.
    "error_decay": lambda v, _: v is None or v == "none" or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1
    ),
    # The factory's own name, which releases before 0.2.0 recorded among
    # its arguments by mistake.
    "caller": lambda v, name: v == name,
}


def current_record(made: Any, path: Any) -> Any:
  """A recorded ``{"name", "args"}`` of a compressor as this version makes
  it: an argument it no longer has is dropped, with a logged note, if its
  value was the one that changed nothing, and refused otherwise.

  Raises:
    ValueError: naming ``path``, the argument and its value, if the
      compressor recorded cannot be made by this version.
  """
  if not isinstance(made, dict) or not isinstance(made.get("args"), dict):
    return made
  args = dict(made["args"])
  for name in sorted(set(args) & set(_RETIRED)):
    value = args.pop(name)
    if not _RETIRED[name](value, made["name"]):
      raise ValueError(
          f"the checkpoint at {path} was saved with {made['name']}'s"
          f" {name}={value!r}, an option this version of acp_jax no longer"
          " has: restore it with the version that saved it"
      )
    logging.getLogger(__name__).warning(
        "%s: ignored %s's %s=%r, recorded by an older acp_jax, which"
        " changed nothing",
        path,
        made["name"],
        name,
        value,
    )
  return {**made, "args": args}


def _show(made: dict[str, Any]) -> str:
  args = ", ".join(f"{k}={v!r}" for k, v in sorted(made["args"].items()))
  return f"{made['name']}({args})"


# A compressor's arguments that change how it sends, not what its state
# holds: a restore into other values of them is sound.
_STATELESS_ARGS = ("axis_name", "bucket_bytes", "leaf_order")


def _stateless(made: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in made["args"].items() if k in _STATELESS_ARGS}


def _strict(made: dict[str, Any]) -> dict[str, Any]:
  args = {k: v for k, v in made["args"].items() if k not in _STATELESS_ARGS}
  return {"name": made["name"], "args": args}


def _check_compressor(directory: str, saved: Any, compressor: Any) -> None:
  """Raises ``ValueError`` unless ``compressor`` is the one recorded at
  save, naming each differing argument, saved and now."""
  saved = current_record(saved, directory)
  now = None if compressor is None else compressor_record(compressor)
  if saved is not None and now is not None:
    loose = differences(_stateless(saved), _stateless(now))
    if loose and _strict(saved) == _strict(now):
      logging.getLogger(__name__).warning(
          "restoring %s: the compressor differs from the one saved only in"
          " settings that do not change its state (%s): restored",
          directory,
          "; ".join(loose),
      )
      return
  if saved == now:
    return
  if now is None:
    raise ValueError(
        "compressor= is missing: pass compressor= to restore, e.g."
        " restore(directory, like, compressor=dp.compressor), so that the"
        f" state goes into the compressor it was saved with; the checkpoint"
        f" at {directory} was saved with {_show(saved)}"
    )
  if saved is None:
    raise ValueError(
        f"the checkpoint at {directory} was saved without compressor=, so"
        f" it cannot be checked against {_show(now)}: restore it without"
        " compressor=, or save it again with one"
    )
  raise ValueError(
      f"the checkpoint at {directory} was saved with another compressor: "
      + "; ".join(differences(saved, now))
      + ". Restore it into the compressor it was saved with."
  )


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

  ``like`` is typically a freshly initialized state (``tx.init(params)``,
  ``nnx.state(optimizer)``); a Q-phase ACP-SGD checkpoint comes back in
  phase Q. See ``target`` for the checks of shapes and dtypes.

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
    ValueError: if the checkpoint holds another state or was saved with
      another compressor (saved and now named); nothing is read from it.
    DamagedError: if a file cannot be read, or an array or the record
      differs from its checksum (the path and the array named).
  """
  directory = str(directory)
  record = _record(directory)
  _check_compressor(directory, record["compressor"], compressor)
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
