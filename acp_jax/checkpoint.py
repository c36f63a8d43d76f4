"""Orbax checkpoints of states that hold a compressor, phase included.

The low-rank compressors record their phase in the shape of a small array
(``lowrank.phase_of``), so a restore into a freshly initialized state, which
is always in its first phase, would ask orbax for the wrong shape. ``restore`` takes the phase from the
checkpoint instead and checks every other array against the live state, so
a checkpoint of another model, rank or device count is refused with both
shapes named, before anything is read.

Needs ``orbax-checkpoint`` (``pip install acp_jax[checkpoint]``).
"""

import os
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import orbax.checkpoint as ocp

from acp_jax import lowrank



def _is_phase(path, x) -> bool:
  """Whether ``x`` at ``path`` is a low-rank phase marker: the one array
  whose shape may differ between a checkpoint and the live state."""
  names = [_key_name(k) for k in path]
  if names and names[-1] == "value":  # inside an NNX Variable
    names.pop()
  return (
      bool(names)
      and names[-1] == "phase"
      and str(x.dtype) == "uint8"
      and tuple(x.shape) in lowrank.MARKER_SHAPES
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


def _saved_arrays(directory: str) -> dict[str, Any]:
  metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(directory))
  if metadata is None or metadata.item_metadata is None:
    raise ValueError(f"{directory} holds no readable orbax checkpoint metadata")
  return {
      name: leaf for name, (_, leaf) in _by_name(metadata.item_metadata.tree).items()
  }


def target(directory: str, like: Any) -> Any:
  """The abstract restore target for the checkpoint at ``directory``.

  Args:
    directory: a checkpoint written by ``save`` (or orbax's
      ``StandardSave``; with a ``CheckpointManager``, the item's directory,
      e.g. ``root/STEP/state``).
    like: the live state (arrays or ``jax.ShapeDtypeStruct``): its structure,
      shapes, dtypes and shardings are what the restore produces, except
      phase markers, whose shape comes from the checkpoint.

  Returns:
    ``like`` with ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    ValueError: if the checkpoint lacks an array of ``like``, holds another,
      or one differs in shape or dtype (saved and now both named).
  """
  saved = _saved_arrays(directory)
  live = _by_name(like)
  missing = sorted(set(live) - set(saved))
  extra = sorted(set(saved) - set(live))
  if missing or extra:
    raise ValueError(
        f"the checkpoint at {directory} was saved from another state: arrays"
        f" only in the live state: {missing or 'none'}; only in the"
        f" checkpoint: {extra or 'none'}"
    )
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
    m = saved[name]
    shape = tuple(x.shape)
    if _is_phase(path, x) and _is_phase(path, m):
      shape = tuple(m.shape)
    elif (tuple(m.shape), str(m.dtype)) != (shape, str(x.dtype)):
      raise ValueError(
          f"{jax.tree_util.keystr(path)}: saved {m.dtype}{list(m.shape)} in"
          f" {directory}, now {x.dtype}{list(shape)}; the checkpoint comes"
          " from another model, compressor setting or device count"
      )
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) and fallback is not None:
      sharding = fallback
    leaves.append(jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding))
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def save(directory: str, state: Any) -> None:
  """Writes ``state`` to ``directory`` (a new path), atomically.

  Orbax writes to a temporary directory and renames it when complete, so an
  interrupted save leaves no checkpoint rather than a partial one.
  """
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(directory), state)
    checkpointer.wait_until_finished()


def restore(directory: str, like: Any) -> Any:
  """The state saved at ``directory``, laid out like ``like``.

  ``like`` is typically a freshly initialized state (``tx.init(params)``,
  ``nnx.state(optimizer)``); a Q-phase ACP-SGD checkpoint comes back in
  phase Q. See ``target`` for the checks.
  """
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(
        os.path.abspath(directory), target(directory, like)
    )
