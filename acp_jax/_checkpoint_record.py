"""What a checkpoint of ``acp_jax.checkpoint`` records, and its checks.

Each check raises ``DamagedError`` for what is not as saved and
``ValueError`` for what another run or version would have to change.
``acp_jax.checkpoint`` holds the public names; the trainer uses them too.
"""

import hashlib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from acp_jax import compressor as compressor_lib

# Notes of a restore go to the logger of the module a user calls.
_LOG = logging.getLogger("acp_jax.checkpoint")


class DamagedError(Exception):
  """A checkpoint not as saved: a file cannot be read, or an array or the
  record differs from its checksum.

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

  Each term is a bijection of its word, so changing one element always
  changes the sum; changing several, or moving one, leaves it unchanged
  with probability about 2**-32. The index comes from iotas, not a reshape,
  so a sharded array is summed where it lies and only partial sums travel."""
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

  Computed on the arrays' devices in one compiled call, as replicated
  scalars: every process gets the same values, and no array is gathered.

  Args:
    tree: a pytree of ``jax.Array`` (sharded or not, addressable or not).

  Returns:
    ``{jax.tree_util.keystr(path): checksum}``, each in ``[0, 2**32)``:
    equal for equal arrays, different with probability about ``1 - 2**-32``
    when any byte differs or elements trade places.
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_checksum_leaves([x for _, x in leaves]))
  return {
      jax.tree_util.keystr(path): int(s)
      for (path, _), s in zip(leaves, sums)
  }


def _digest(record: dict[str, Any]) -> str:
  text = json.dumps(record, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def sealed(record: dict[str, Any]) -> dict[str, Any]:
  """``record`` (JSON-serializable) with a digest of itself added, for
  ``unsealed`` to catch a changed byte anywhere in it."""
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
  differ from ``saved``. Collective: call it on every process alike."""
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
  """One line for a failed orbax read: the array whose file failed (where
  TensorStore's key names one) and the first line of the root error."""
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


# Factory arguments older versions recorded and this one lacks, each with a
# test, of the value and the factory's name, that the value changed nothing.
_RETIRED = {
    # DeMo-style decay of the residual; 1 (or "none" in older records) kept
    # it whole, as every low-rank compressor now does.
    "error_decay": lambda v, _: v is None or v == "none" or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1
    ),
    # The factory's name, recorded among its arguments before 0.2.0.
    "caller": lambda v, name: v == name,
}


def current_record(made: Any, path: Any) -> Any:
  """A recorded ``{"name", "args"}`` of a compressor as this version makes
  it: an argument it no longer has is dropped, with a logged note, if its
  value changed nothing.

  Raises:
    ValueError: naming ``path``, the argument and its value, otherwise.
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
    _LOG.warning(
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


def check_compressor(directory: str, saved: Any, compressor: Any) -> None:
  """Raises ``ValueError`` unless ``compressor`` is the one recorded at
  save, naming each differing argument, saved and now."""
  saved = current_record(saved, directory)
  now = None if compressor is None else compressor_record(compressor)
  if saved is not None and now is not None:
    loose = differences(_stateless(saved), _stateless(now))
    if loose and _strict(saved) == _strict(now):
      _LOG.warning(
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


def log_abandoned_reads(
    log: Callable[[str], None] | None = None,
) -> None:
  """Sends the errors of the reads that a failed restore abandons to a debug
  log, not the console; call it once, at start-up.

  When one array cannot be read, orbax raises and closes its event loop
  while TensorStore still reads the others; each of those reads then raises
  ("Event loop is closed", or TensorStore's whole spec) as an unraisable
  exception: a traceback per array beside the one ``DamagedError`` line.
  This replaces ``sys.unraisablehook`` with one that hands those to ``log``
  (default: the ``acp_jax.checkpoint`` logger, at debug level) and every
  other to the hook before it."""
  before = sys.unraisablehook
  log = log or (lambda text: _LOG.debug("%s", text))

  def hook(unraisable):
    if not _abandoned_read(unraisable.exc_value, unraisable.exc_traceback):
      before(unraisable)
      return
    log(
        "an abandoned checkpoint read raised: "
        + "".join(
            traceback.format_exception(
                unraisable.exc_type,
                unraisable.exc_value,
                unraisable.exc_traceback,
            )
        )
    )

  sys.unraisablehook = hook


def _abandoned_read(error: BaseException | None, tb: Any) -> bool:
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True  # asyncio's, from an orbax read handing back its result
  return any(
      f"{os.sep}orbax{os.sep}" in frame.filename
      for frame in traceback.extract_tb(tb)
  )
