"""PartitionSpecs: reading them, and the ones of a step's batch arguments."""

import collections
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def is_spec(x) -> bool:
  return isinstance(x, P)


def batch_specs(
    batch: tuple, batch_specs: Any, device_spec: P, num_devices: int
) -> tuple:
  """Each batch argument's tree of leaf ``PartitionSpec``s: the user's, its
  placement's, or else its leading axis split (assumed). Split axes must
  divide evenly over the devices, and an assumed split agree in size with
  the others."""
  if batch_specs is None:
    batch_specs = (None,) * len(batch)
  if not isinstance(batch_specs, (tuple, list)) or len(batch_specs) != len(
      batch
  ):
    raise ValueError(
        f"batch_specs must hold one entry per argument after the params"
        f" ({len(batch)} in this call), got {batch_specs!r}"
    )
  specs, splits = [], []  # splits: (name, size, axis, assumed)
  unseen = []  # (name, shape): assumed while traced, placement unseen
  for i, (arg, given) in enumerate(zip(batch, batch_specs)):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
    if given is not None:
      given = _broadcast_specs(given, arg, f"batch_specs[{i}]")
    leaf_specs = []
    for j, (path, x) in enumerate(leaves):
      name = (
          f"argument {i + 1}{jax.tree_util.keystr(path)} of the loss"
          f" (batch_specs[{i}])"
      )
      if given is None:
        spec, assumed = _inferred_spec(name, x, device_spec)
      else:
        spec, assumed = given[j], False
      dim = _split_dim(name, np.shape(x), spec, device_spec, num_devices)
      if dim is not None:
        splits.append((name, np.shape(x)[dim], dim, assumed))
        if assumed and isinstance(x, jax.core.Tracer):
          unseen.append((name, np.shape(x)))
      leaf_specs.append(spec)
    specs.append(jax.tree_util.tree_unflatten(treedef, leaf_specs))
  _check_split_sizes(splits, device_spec[0])
  if len(unseen) == len(splits):
    _check_not_time_major(unseen, device_spec[0], num_devices)
  return tuple(specs)


def _inferred_spec(name: str, x: Any, device_spec: P) -> tuple[P, bool]:
  """A leaf's spec without ``batch_specs``, and whether it is assumed
  (split along the leading axis for want of anything saying otherwise)."""
  if not np.shape(x):
    return P(), False
  placed = placement(x)
  if placed is not None:
    dims = [
        d
        for d, entry in enumerate(placed)
        if set(spec_axes(entry)) & set(spec_axes(device_spec[0]))
    ]
    if len(dims) > 1:
      raise ValueError(
          f"{name} is sharded as {placed}, over the device axes along"
          f" {len(dims)} of its axes: pass batch_specs to say which one is"
          " the batch"
      )
    if dims:
      return P(*(None,) * dims[0], device_spec[0]), False
  return device_spec, True


def _split_dim(
    name: str, shape: tuple, spec: P, device_spec: P, num_devices: int
) -> int | None:
  """The axis ``spec`` splits over the devices (None: every device gets
  the leaf whole), refusing specs that are not data-parallel."""
  entry = device_spec[0]
  device_axes = spec_axes(entry)
  hint = (
      f"name the device axes on the batch axis (e.g. P(None, {entry!r}) for"
      " a time-major batch) or none (P(): every device gets it whole)"
  )
  if not isinstance(spec, P):
    raise TypeError(
        f"{name}: batch spec {spec!r} is not a PartitionSpec; {hint}"
    )
  if len(spec) > len(shape):
    raise ValueError(
        f"{name} has shape {shape}, too few axes for its batch spec {spec}"
    )
  named = [a for e in spec for a in spec_axes(e)]
  if not named:
    return None
  dims = [d for d, e in enumerate(spec) if spec_axes(e)]
  if sorted(named) != sorted(device_axes) or len(dims) > 1:
    raise ValueError(f"{name}: batch spec {spec} is not data-parallel; {hint}")
  (dim,) = dims
  if shape[dim] % num_devices:
    raise ValueError(
        f"{name} has shape {shape}: its axis {dim} must split evenly over"
        f" the {num_devices} devices of mesh axes"
        f" {', '.join(map(repr, device_axes))} (or pass batch_specs"
        " to split another axis, or P() for an argument every device gets"
        " whole)"
    )
  return dim


def placement(x: Any) -> P | None:
  """The spec of ``x``'s sharding, where JAX exposes it: a concrete array's,
  or a traced one's on ``Explicit`` mesh axes (``Auto`` axes do not show
  while tracing)."""
  try:
    sharding = x.sharding
  except AttributeError:  # a tracer, or not a jax.Array
    sharding = getattr(jax.typeof(x), "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def spec_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one entry of a ``PartitionSpec`` names."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def is_replicated(spec: P) -> bool:
  return not any(spec_axes(e) for e in spec)


def _broadcast_specs(given: Any, arg: Any, where: str) -> list[P]:
  """The leaf specs of ``arg`` from ``given``, a prefix tree of it."""
  try:
    tree = jax.tree.map(
        lambda spec, sub: jax.tree.map(lambda _: spec, sub),
        given,
        arg,
        is_leaf=is_spec,
    )
  except ValueError as e:
    raise ValueError(
        f"{where} is not a PartitionSpec or a prefix tree of the argument's"
        f" structure: {e}"
    ) from None
  return jax.tree.leaves(tree, is_leaf=is_spec)


def _check_split_sizes(splits: list, entry: Any) -> None:
  """Refuses an assumed leading-axis split whose size disagrees with the
  other split axes: then that axis is probably not the batch."""
  fixed = {size for _, size, _, assumed in splits if not assumed}
  if not fixed and splits:
    # The batch: the size most leaves share, the larger on a tie (a leading
    # axis beside the batch is time or channels, usually fewer).
    counts = collections.Counter(size for _, size, _, _ in splits)
    fixed = {max(counts, key=lambda size: (counts[size], size))}
  for name, size, dim, assumed in splits:
    if assumed and size not in fixed:
      other, other_size, other_dim, _ = next(s for s in splits if s[1] in fixed)
      raise ValueError(
          f"{name} would be split over the devices along its axis {dim}, of"
          f" size {size}, but {other} along its axis {other_dim}, of size"
          f" {other_size}: which axis is the batch is ambiguous. Say it with"
          " value_and_grad(fun, batch_specs=...), one entry per argument"
          " after the params: P() for one that every device gets whole (e.g."
          f" BatchNorm statistics), P(None, {entry!r}) for a time-major"
          " batch; or place the arrays with a NamedSharding (seen outside"
          " jit, or under jit on Explicit mesh axes)."
      )


def _check_not_time_major(unseen: list, entry: Any, num_devices: int) -> None:
  """Refuses leading-axis splits that could as well be time-major: traced
  arrays whose placement does not show (``jit`` on ``Auto`` axes), of two
  or more axes, axis 1 agreeing in size and splitting evenly, and shapes
  that allow a time axis 0: axes 0 and 1 of one size, an axis 0 of one row
  per device, or arguments sharing axes 0 and 1 at other ranks (x (T, B, F)
  beside y (T, B) reads as well as x (B, T, F) beside y (B, T)). Arguments
  of one rank and other sizes (tokens, targets (B, T)) are batch-major."""
  shapes = [shape for _, shape in unseen]
  if not shapes or any(len(shape) < 2 for shape in shapes):
    return
  rows, cols = shapes[0][:2]
  if len({shape[1] for shape in shapes}) > 1 or cols % num_devices:
    return
  if rows == cols:
    why = f"axes 0 and 1 are both of size {rows}"
  elif rows == num_devices:
    why = (
        f"axis 0 is of size {rows}, one row per device: as well {rows} time"
        " steps"
    )
  elif len({len(shape) for shape in shapes}) > 1:
    why = (
        f"its axes 0 and 1 ({rows}, {cols}) are those of every other batch"
        " argument, of another rank, as in x (B, T, F) beside y (B, T) and"
        " as well in a time-major x (T, B, F) beside y (T, B)"
    )
  else:
    return
  name, shape = unseen[0]
  raise ValueError(
      f"{name} has shape {shape}, and {why}: under jit on Auto mesh axes its"
      " sharding does not show, so whether the batch is axis 0 or a"
      " time-major axis 1 is ambiguous. Say it with"
      " value_and_grad(fun, batch_specs=...), one entry per argument after"
      f" the params: P({entry!r}) for a batch on axis 0, P(None, {entry!r})"
      " for a time-major one; or use Explicit mesh axes, or call the step"
      " outside jit, where the placement shows."
  )


def check_explicit_placement(
    batch: tuple, specs: tuple, mesh: jax.sharding.Mesh, device_axes: tuple
) -> None:
  """Refuses, naming the fix, a traced argument to be split over
  ``Explicit`` device axes whose type does not show that split (an unplaced
  ``jnp`` array under ``jit``): ``shard_map``'s own error names neither."""
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  if all(kinds[a] != jax.sharding.AxisType.Explicit for a in device_axes):
    return
  for i, (arg, arg_specs) in enumerate(zip(batch, specs)):
    leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
    for (path, x), spec in zip(
        leaves, jax.tree.leaves(arg_specs, is_leaf=is_spec)
    ):
      if not isinstance(x, jax.core.Tracer) or is_replicated(spec):
        continue
      dim = next(d for d, e in enumerate(spec) if spec_axes(e))
      placed = placement(x)
      placed = P() if placed is None else placed
      here = placed[dim] if dim < len(placed) else None
      if set(spec_axes(here)) == set(spec_axes(spec[dim])):
        continue
      raise ValueError(
          f"acp_jax DataParallel.value_and_grad: argument"
          f" {i + 1}{jax.tree_util.keystr(path)} of the loss, of shape"
          f" {tuple(x.shape)}, is to be split over the Explicit mesh axes"
          f" along its axis {dim}, as {spec}, but its type's sharding is"
          f" {placed}: shard_map takes it only placed so. Place it before"
          f" the jitted step, jax.device_put(x, NamedSharding(mesh, {spec})),"
          " or inside it, jax.reshard(x, NamedSharding(mesh, "
          f"{spec})); or make the mesh with Auto axes, jax.make_mesh(...,"
          " axis_types=(jax.sharding.AxisType.Auto,))."
      )
