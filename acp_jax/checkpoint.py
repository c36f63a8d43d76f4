"""Verified orbax checkpoints of states that hold a compressor, phase included.

``save`` writes the state through orbax with a record in the checkpoint's
own metadata: a checksum of every array (computed on the devices, so it
works across processes), the compressor's factory and arguments, and a
digest of the record itself. ``restore`` refuses a checkpoint of another
state or compressor, naming saved and now, before any array is read, and
raises ``DamagedError`` (naming the path and the array) if a file cannot be
read or an array or the record no longer matches its checksum.

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

import hashlib
import json
import os
import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import orbax.checkpoint as ocp

from acp_jax import phase as phase_lib

# The key of this module's record in an orbax checkpoint's custom metadata.
_RECORD = "acp_jax"


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


def _plain(value: Any) -> Any:
  """``value`` as JSON that compares equal exactly when the setting does:
  dtypes by name, functions by qualified name."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  try:
    return str(jnp.dtype(value))
  except TypeError:
    pass
  if hasattr(value, "__qualname__"):  # repr would hold its address
    return f"{value.__module__}.{value.__qualname__}"
  return repr(value)


def compressor_record(compressor: Any) -> dict[str, Any]:
  """``{"name": factory, "args": {argument: value}}`` of a compressor made
  by one of this package's factories, as a checkpoint records it."""
  made_by = getattr(compressor, "made_by", None)
  if made_by is None:
    raise TypeError(
        "compressor must be made by an acp_jax factory (e.g."
        f" DataParallel.compressor), got {type(compressor).__name__}"
    )
  name, args = made_by
  return {"name": name, "args": _plain(args)}


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
    metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(directory))
    tree = metadata.item_metadata.tree
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
) -> dict[str, tuple[int, ...]]:
  """The shape to restore of each live array: its own, or a phase marker's
  saved one. Raises ``ValueError`` naming missing and extra arrays, or the
  first that differs in shape or dtype, saved and now."""
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
    if _is_phase(path, *now) and _is_phase(path, dtype, shape):
      shapes[name] = shape
    elif (dtype, shape) != now:
      raise ValueError(
          f"{jax.tree_util.keystr(path)}: saved {dtype}{list(shape)} in"
          f" {directory}, now {now[0]}{list(now[1])}; the checkpoint comes"
          " from another model, optimizer or compressor setting or device"
          " count"
      )
    else:
      shapes[name] = shape
  return shapes


def target(directory: str, like: Any, *, saved: Any = None) -> Any:
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

  Returns:
    ``like`` with ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    ValueError: if the checkpoint lacks an array of ``like``, holds another,
      or one differs in shape or dtype (saved and now both named).
    DamagedError: if its metadata cannot be read (or differs from
      ``saved``).
  """
  live = _by_name(like)
  if saved is not None:
    _shapes(
        directory,
        {name: (dtype, tuple(shape)) for name, (dtype, shape) in saved.items()},
        live,
    )
  try:
    shapes = _shapes(directory, _saved_arrays(directory), live)
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
  for name, (_, x) in live.items():
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) and fallback is not None:
      sharding = fallback
    leaves.append(
        jax.ShapeDtypeStruct(shapes[name], x.dtype, sharding=sharding)
    )
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


def save(directory: str, state: Any, *, compressor: Any = None) -> None:
  """Writes ``state`` to ``directory`` (a new path), atomically, with a
  checksum of every array and, given ``compressor`` (e.g.
  ``DataParallel.compressor``), its factory and arguments.

  Orbax writes to a temporary directory and renames it when complete, so an
  interrupted save leaves no checkpoint rather than a partial one.
  """
  record = {
      "checksums": checksums(state),
      "layout": layout(state),
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


def _record(directory: str) -> dict[str, Any]:
  try:
    metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(directory))
    custom = metadata.custom_metadata or {}
  except Exception as e:  # pylint: disable=broad-except
    raise DamagedError(
        directory, f"its metadata cannot be read: {describe_read_error(e)}"
    ) from None
  if _RECORD not in custom:
    raise ValueError(
        f"{directory} was not written by acp_jax.checkpoint.save (it holds no"
        " checksums); restore it with orbax itself, through"
        " acp_jax.checkpoint.target"
    )
  return unsealed(custom[_RECORD], directory)


def _show(made: dict[str, Any]) -> str:
  args = ", ".join(f"{k}={v!r}" for k, v in sorted(made["args"].items()))
  return f"{made['name']}({args})"


def _check_compressor(directory: str, saved: Any, compressor: Any) -> None:
  """Raises ``ValueError`` unless ``compressor`` is the one recorded at
  save, naming each differing argument, saved and now."""
  now = None if compressor is None else compressor_record(compressor)
  if saved == now:
    return
  if now is None:
    raise ValueError(
        f"the checkpoint at {directory} was saved with compressor"
        f" {_show(saved)}: pass compressor= to restore, so that it is"
        " restored into the same compressor"
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


def restore(directory: str, like: Any, *, compressor: Any = None) -> Any:
  """The state saved at ``directory``, laid out like ``like``, verified.

  ``like`` is typically a freshly initialized state (``tx.init(params)``,
  ``nnx.state(optimizer)``); a Q-phase ACP-SGD checkpoint comes back in
  phase Q. See ``target`` for the checks of shapes and dtypes.

  Args:
    directory: a checkpoint written by ``save``.
    like: the live state.
    compressor: the compressor the state is for, when ``save`` was given
      one: another factory, or the same with any other argument, is refused.

  Raises:
    ValueError: if the checkpoint holds another state or was saved with
      another compressor (saved and now named); nothing is read from it.
    DamagedError: if a file cannot be read, or an array or the record
      differs from its checksum (the path and the array named).
  """
  directory = str(directory)
  record = _record(directory)
  _check_compressor(directory, record["compressor"], compressor)
  abstract = target(directory, like, saved=record["layout"])
  with ocp.StandardCheckpointer() as checkpointer:
    state = read(
        directory,
        lambda: checkpointer.restore(os.path.abspath(directory), abstract),
    )
  verify(state, record["checksums"], directory)
  return state
