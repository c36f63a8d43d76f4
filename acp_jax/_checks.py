"""The checks of the compressors' arguments and of where their updates run.

A factory checks its hyperparameters once, when it runs, by one call of
``factory_args``; an update checks what it is given and where it is traced
(``begin_update``), which costs nothing at run time. One module on
purpose: every check a compressor makes lives here, once, so that each
factory and update calls it rather than writing its own.
"""

from collections.abc import Callable, Sequence
import os
import sys
import warnings
from typing import Any

import jax
import jax.extend
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import buckets
from acp_jax import collectives
from acp_jax import state_trees


def _is_int(value: Any, types: tuple[type, ...] = (int,)) -> bool:
  return isinstance(value, types) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return _is_int(value, (int, float))


def integer(name: str, value: Any, minimum: int, *, numpy: bool = False) -> Any:
  """``value``; raises unless it is an int (or, with ``numpy``, a NumPy
  integer) of at least ``minimum``, 0 or 1."""
  types = (int, np.integer) if numpy else (int,)
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"{name} must be a Python int known outside jit, got a traced"
        f" {jax.typeof(value).str_short()}: it decides which program the"
        " step compiles, so it is read on the host. Call it outside the"
        " jitted function (opt_state = dp.at_step(opt_state, step) in the"
        " loop, before the jitted step), with the number of steps taken."
    )
  if not _is_int(value, types) or value < minimum:
    kind = "positive" if minimum == 1 else "non-negative"
    raise ValueError(f"{name} must be a {kind} int, got {value!r}")
  return value


def flag(name: str, value: Any) -> bool:
  """``value``; raises unless it is a bool."""
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return value


def choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
  """``value``; raises unless it is one of ``choices``."""
  if value not in choices:
    raise ValueError(
        f"{name} must be one of {', '.join(map(repr, choices))}, got"
        f" {value!r}"
    )
  return value


def comm_dtype(value: Any, caller: str) -> Any:
  """``value``; raises unless it is None or a floating dtype, and warns of
  one with a narrower exponent than float32's (float16, float8): a sum over
  the devices of gradients or factors past its largest value is inf."""
  if value is None:
    return None
  try:
    floating = jnp.issubdtype(value, jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise ValueError(
        f"comm_dtype must be a floating dtype or None, got {value!r}"
    )
  info = jnp.finfo(value)
  if info.maxexp < jnp.finfo(jnp.float32).maxexp:
    warnings.warn(
        f"{caller}: comm_dtype={info.dtype.name} holds no value past"
        f" {float(info.max):g}: a value sent, or its sum over the devices,"
        " beyond it (a large gradient, a loss spike) becomes inf, and the"
        " params NaN."
        " bfloat16 sends as many bytes with float32's range:"
        " comm_dtype=jnp.bfloat16.",
        UserWarning,
        stacklevel=2,
    )
  return value


def bucket_bytes(value: Any, caller: str) -> float:
  """``value``, or ``buckets.DEFAULT_BUCKET_BYTES`` for None; raises
  unless it is a positive number (``math.inf``: one bucket)."""
  if value is None:
    return buckets.DEFAULT_BUCKET_BYTES
  if not _is_number(value) or not value > 0:
    raise ValueError(
        f"{caller}: bucket_bytes must be a positive number (math.inf for one"
        f" bucket), got {value!r}"
    )
  return value


def leaf_order(value: Any, caller: str) -> tuple[int, ...] | None:
  """``value`` as a tuple, or None; raises unless it is None or a sequence
  of distinct non-negative ints."""
  if value is None:
    return None
  try:
    order = tuple(value)
  except TypeError:
    order = None
  if (
      order is None
      or not all(_is_int(i) and i >= 0 for i in order)
      or len(set(order)) != len(order)
  ):
    raise ValueError(
        f"{caller}: leaf_order must be None or a sequence of distinct leaf"
        " indices (e.g. acp_jax.backward_order(loss, params, batch)), got"
        f" {value!r}"
    )
  return order


def _non_negative_number(name: str, value: Any) -> Any:
  if not _is_number(value) or not value >= 0:
    raise ValueError(f"{name} must be a non-negative number, got {value!r}")
  return value


def _density(value: Any) -> Any:
  if not _is_number(value) or not 0 < value <= 1:
    raise ValueError(f"density must be a number in (0, 1], got {value!r}")
  return value


# How ``factory_args`` checks each argument, (value, factory name) -> value.
_RULES: dict[str, Callable[[Any, str], Any]] = {
    "rank": lambda v, _: integer("rank", v, 1),
    "min_compression_rate": lambda v, _: _non_negative_number(
        "min_compression_rate", v
    ),
    "density": lambda v, _: _density(v),
    "seed": lambda v, _: v,
    "warmup_steps": lambda v, _: integer(
        "warmup_steps", 0 if v is None else v, 0
    ),
    "use_error_feedback": lambda v, _: flag("use_error_feedback", v),
    "warm_start": lambda v, _: flag("warm_start", v),
    "warmup_factors": lambda v, _: flag("warmup_factors", v),
    "majority_vote": lambda v, _: flag("majority_vote", v),
    "comm_dtype": comm_dtype,
    "bucket_bytes": bucket_bytes,
    "leaf_order": leaf_order,
}
# The numeric arguments that fix what is communicated (see ``_check_static``).
_STATIC = (
    "rank",
    "min_compression_rate",
    "density",
    "seed",
    "bucket_bytes",
    "warmup_steps",
)


def factory_args(caller: str, **args: Any) -> dict[str, Any]:
  """A factory's arguments, checked in the order given; returns them with
  None resolved (``bucket_bytes``: 25 MiB, ``warmup_steps``: 0) and
  ``leaf_order`` as a tuple. Raises ``ValueError`` naming the argument, the
  value and the fix."""
  _check_static(caller, {k: v for k, v in args.items() if k in _STATIC})
  return {name: _RULES[name](value, caller) for name, value in args.items()}


def _check_static(caller: str, args: dict[str, Any]) -> None:
  """Raises if a factory argument that fixes shapes arrived as an array.

  ``optax.inject_hyperparams`` turns numeric arguments into arrays; these
  ones decide what is sent (ranks, k), so they must stay Python numbers.
  """
  arrays = [
      k for k, v in args.items() if isinstance(v, (jax.Array, np.ndarray))
  ]
  if arrays:
    names = ", ".join(repr(k) for k in args)
    raise ValueError(
        f"{caller}: {', '.join(arrays)} arrived as an array"
        f" ({args[arrays[0]]!r}), as optax.inject_hyperparams makes it; it"
        " fixes the shapes that are communicated, so it must be a Python"
        f" number. Use optax.inject_hyperparams({caller},"
        f" static_args=({names},)), or inject the hyperparameters of the"
        " optimizer that follows the compressor."
    )


def check_float_leaves(params: Any, caller: str) -> None:
  """Raises if a leaf is not a real floating-point array, or if some leaves
  were masked away from the compressor."""
  if any(
      state_trees.is_masked(x)
      for x in jax.tree.leaves(params, is_leaf=state_trees.is_masked)
  ):
    raise ValueError(
        f"{caller} was given params with masked-out leaves: it sits inside"
        " optax.masked or optax.multi_transform. Their gradients would then"
        " skip the compressor and never be averaged across devices, and the"
        " replicas would drift apart. Give every gradient to the compressor"
        " and mark the leaves to send uncompressed with its keep_dense"
        " argument (power_sgd, acp_sgd), or mask the optimizer after it."
    )
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{caller}: leaf {jax.tree_util.keystr(path)} has dtype {dtype};"
          " only real floating-point parameters can be compressed."
      )


def check_tree_matches(grads: Any, state_tree: Any, caller: str) -> None:
  """Raises unless ``grads`` has the structure and shapes of ``state_tree``,
  a tree that mirrors the params the state was initialized from."""
  state_def = jax.tree.structure(state_tree, is_leaf=state_trees.is_masked)
  grads_def = jax.tree.structure(grads)
  if state_def != grads_def:
    raise ValueError(
        f"{caller}: the gradient tree {grads_def} does not match the tree the"
        f" state was initialized with, {state_def}."
    )
  pairs = zip(
      jax.tree_util.tree_leaves_with_path(grads),
      state_trees.state_leaves(state_tree),
  )
  for (path, g), s in pairs:
    if not state_trees.is_masked(s) and s.shape != g.shape:
      raise ValueError(
          f"{caller}: gradient {jax.tree_util.keystr(path)} has shape"
          f" {g.shape}, but the state was initialized for {s.shape}."
      )


def check_state(state: Any, expected: type, caller: str) -> None:
  """Raises unless ``state`` is of the type ``caller``'s init makes."""
  if not isinstance(state, expected):
    raise TypeError(
        f"{caller} was given a {type(state).__name__}, not the"
        f" {expected.__name__} its init makes: the state comes from another"
        " compressor. Init and update must come from the same factory call"
        " (after a change of compressor, start from a fresh init)."
    )


def _varying_axes(x) -> frozenset | None:
  """Mapped axes over which ``x`` may differ, if JAX tracks them here."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return aval.manual_axis_type.varying
  return getattr(aval, "vma", None)


# Collectives whose result is the same on every device of their axes.
_REDUCING = frozenset(
    (
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
    )
)
_LOCAL, _REDUCED, _CONSTANT = "local", "reduced", "constant"
# How far back through the traced equations a gradient's origin is sought;
# further back, it counts as local (the check then never raises).
_PROVENANCE_DEPTH = 32


def _collective_axes(params: dict) -> tuple | None:
  axes = params.get("axes", params.get("axis_name"))
  if axes is None:
    return None
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _provenance(x: Any, axis_name: str, depth: int, memo: dict) -> str:
  """Whether a traced value comes from a collective over ``axis_name``
  (``_REDUCED``: identical on every device by construction), from literals
  only (``_CONSTANT``), or possibly from device-local data (``_LOCAL``).

  It follows the equations that produced ``x`` in the jaxpr being traced,
  as varying-axis types would (they are off under ``jax.pmap`` and
  ``check_vma=False``): a result of a reducing collective over the axis is
  reduced, and another equation's result is as local as its most local
  operand. Anything it cannot see through (an input, a nested jaxpr, a
  collective that permutes, more than ``_PROVENANCE_DEPTH`` equations) is
  local, so it errs only towards not raising.
  """
  key = id(x)
  if key in memo:
    return memo[key]
  parent = getattr(x, "parent", None)
  if parent is None or depth > _PROVENANCE_DEPTH:
    literal = isinstance(getattr(x, "val", None), jax.extend.core.Literal)
    return _CONSTANT if literal else _LOCAL
  name = parent.primitive.name
  axes = _collective_axes(parent.params)
  if axes is not None and axis_name in axes:
    kind = _REDUCED if name in _REDUCING else _LOCAL
  elif (axes is not None and name not in _REDUCING) or any(
      isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))
      for v in parent.params.values()
  ):
    kind = _LOCAL
  else:
    kind = _CONSTANT
    for operand in parent.in_tracers:
      operand_kind = _provenance(operand, axis_name, depth + 1, memo)
      if operand_kind == _LOCAL:
        kind = _LOCAL
        break
      if operand_kind == _REDUCED:
        kind = _REDUCED
  memo[key] = kind
  return kind


def is_constant(x: Any) -> bool:
  """Whether a traced value is computed from literals only (see
  ``_provenance``): e.g. the gradient of a param the loss never reads,
  which ``jax.grad`` makes from a zero literal. XLA folds a collective of
  such a value away (measured: an all-reduce of zeros or of ones, an
  all-gather of zeros), so it sends nothing."""
  return _provenance(x, None, 0, {}) == _CONSTANT


def from_sources(
    x: Any, sources: set[int], axes: tuple[str, ...], depth: int = 0
) -> bool:
  """Whether a traced value provably depends on one of ``sources`` (ids
  of tracers: each device's shard of the batch) or on the device index,
  through no reducing collective over ``axes``: then it differs across
  devices. Like ``_provenance``, it gives up (False) at what it cannot
  see through: a nested jaxpr, more than ``_PROVENANCE_DEPTH`` equations.
  A value traced under ``jax.grad`` is followed through its primal."""
  while hasattr(x, "primal"):
    x = x.primal
  if id(x) in sources:
    return True
  parent = getattr(x, "parent", None)
  if parent is None or depth > _PROVENANCE_DEPTH:
    return False
  name = parent.primitive.name
  collective = _collective_axes(parent.params)
  if name == "axis_index":
    return True
  if collective is not None and set(axes) <= set(collective):
    return name not in _REDUCING
  if any(
      isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))
      for v in parent.params.values()
  ):
    return False
  return any(
      from_sources(t, sources, axes, depth + 1) for t in parent.in_tracers
  )


def check_local(grads: Any, axis_name: str, caller: str) -> None:
  """Raises if every gradient is provably identical across ``axis_name``.

  Under ``jax.shard_map`` (check_vma=True), ``jax.grad`` with respect to
  replicated params all-reduces the gradient densely by itself, and the
  compressor would then add its own traffic on top of a full S-SGD step.
  Where JAX tracks varying axes, their types tell; elsewhere (``jax.pmap``,
  ``check_vma=False``) the traced equations do: gradients computed from a
  ``lax.psum``, ``lax.pmean`` or all-gather over the axis are refused.
  """
  leaves = jax.tree.leaves(grads)
  if not leaves:
    return
  if axis_name in (_varying_axes(lax.axis_index(axis_name)) or ()):
    if not any(axis_name in _varying_axes(g) for g in leaves):
      raise ValueError(
          f"{caller}: the gradients are already identical across axis"
          f" {axis_name!r}, so jax.grad all-reduced them densely before the"
          " compressor saw them (it does so for params replicated under"
          " jax.shard_map). Differentiate with respect to"
          f" jax.lax.pcast(params, {axis_name!r}, to='varying') so each"
          " device hands over its own gradient."
      )
    return
  memo = {}
  kinds = {_provenance(g, axis_name, 0, memo) for g in leaves}
  if kinds == {_REDUCED} or kinds == {_REDUCED, _CONSTANT}:
    raise ValueError(
        f"{caller}: the gradients were already averaged over axis"
        f" {axis_name!r} (by lax.pmean, lax.psum or an all-gather before the"
        " compressor), so the step would send them densely and then"
        " compressed. Hand the compressor each device's own gradient, not"
        " its mean: its update returns the mean."
    )


_COMBINING = os.path.join("optax", "transforms", "_combining.py")
_EXTRA_ARGS = os.path.join("optax", "_src", "base.py")


def check_first_in_chain(caller: str, frame: Any) -> None:
  """Raises if the update runs in an ``optax.chain`` after another transform.

  The transforms before it would see each device's own gradient, not the
  mean (under ``jax.pmap`` or ``jax.shard_map``): Adam's moments, a clipping
  norm or a scale computed per device, then averaged. optax gives a
  transform no way to know its place, so the frames of the chains that call
  this update are read (optax's ``chain`` and ``named_chain``, nested ones
  too), from ``frame``, the update's caller; it runs only while tracing.
  """
  while frame is not None:
    code = frame.f_code
    if code.co_filename.endswith(_EXTRA_ARGS) and code.co_name == "update":
      frame = frame.f_back  # with_extra_args_support's wrapper
      continue
    if not (
        code.co_filename.endswith(_COMBINING) and code.co_name == "update_fn"
    ):
      return
    local = frame.f_locals
    if "update_fns" in local:  # optax.chain
      position = [f is local["fn"] for f in local["update_fns"]].index(True)
    elif "transforms" in local:  # optax.named_chain
      tx = local["tx"]
      position = [t is tx for _, t in local["transforms"]].index(True)
    else:
      return
    if position:
      raise ValueError(
          f"{caller} is transform {position} of an optax.chain, after"
          f" {position} other transform(s): those see each device's own"
          " gradient, before it is averaged, and would compute per device"
          " what the same loop without compression computes on the mean"
          " (Adam's moments, a clipping norm). Put the compressor first,"
          f" optax.chain({caller}(...), optax.adam(...)): everything after it"
          " sees the mean gradient."
      )
    frame = frame.f_back


_CONDITIONALS = os.path.join("lax", "control_flow", "conditionals.py")
# optax wrappers that run their inner update under lax.cond, and what to do.
_CONDITIONAL_WRAPPERS = {
    "MultiSteps.update": (
        "optax.MultiSteps puts its inner update there: it would communicate"
        " at every micro-step. To accumulate gradients, add up the local"
        " gradients of k micro-batches from"
        " acp_jax.DataParallel.value_and_grad and call the optimizer once:"
        " one compressed send per k micro-steps."
    ),
    "apply_if_finite.<locals>.update": (
        "optax.apply_if_finite puts its inner update there. Put it inside"
        " instead, around the optimizer: dp.chain(optax.apply_if_finite(tx,"
        " n)) (or optax.chain(compressor, optax.apply_if_finite(tx, n)));"
        " DataParallel keeps the compressor's state as it was when a"
        " gradient is not finite (its nonfinite argument)."
    ),
}


def check_not_in_conditional(caller: str) -> None:
  """Raises if the update is being traced inside a ``lax.cond`` branch.

  A conditional is one HLO instruction: collectives inside it can neither
  fuse with others nor overlap backprop, and on GPU it stalls the host once
  per step. optax's wrappers are the usual way in: ``optax.MultiSteps`` runs
  its inner update under ``lax.cond`` at every micro-step, so a compressor
  would send its bytes k times per applied update (and ACP-SGD's phase,
  chosen there by ``jnp.where``, would never advance);
  ``optax.apply_if_finite`` runs it under ``lax.cond`` of the update's
  finiteness. JAX offers no public query for this, so the Python stack is
  read (JAX's own record of what each enclosing trace is for lives in its
  private ``jax._src.core``, and the stack names the optax wrapper, which
  the fix depends on); it runs only while tracing.
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  in_cond = False
  while frame is not None:
    code = frame.f_code
    if code.co_filename.endswith(_CONDITIONALS) and code.co_name in (
        "cond",
        "switch",
    ):
      in_cond = True
    fix = _CONDITIONAL_WRAPPERS.get(getattr(code, "co_qualname", ""))
    if in_cond and (fix or frame.f_back is None):
      raise ValueError(
          f"{caller} is being traced inside a lax.cond branch. Collectives in"
          " a conditional cannot fuse or overlap with backprop. "
          + (fix or "Call the update outside lax.cond and lax.switch.")
      )
    frame = frame.f_back


# States of optax transforms that precondition by moments of the gradient:
# after compressed_adam, which is Adam already, they would scale twice.
_PRECONDITIONER_STATES = tuple(
    getattr(optax, name)
    for name in (
        "ScaleByAdamState",
        "ScaleByAmsgradState",
        "ScaleByBeliefState",
        "ScaleByRmsState",
        "ScaleByRssState",
        "ScaleByNovogradState",
        "ScaleByAdanState",
        "ScaleByLionState",
        "FactoredState",
    )
    if hasattr(optax, name)
)


def _states_of(tree: Any, types: tuple[type, ...]) -> list[Any]:
  """The nodes of ``tree`` that are instances of ``types``."""
  return [
      x
      for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
      if isinstance(x, types)
  ]


def check_optimizer_after(compressor_name: str, inner_state: Any) -> None:
  """Raises if the optimizer that ``DataParallel.chain`` feeds holds a
  transform that cannot follow the compressor, read from its state (an
  optax transform's state type names it, however deeply it is chained):

  - ``optax.MultiSteps``: the compressed exchange runs before it at every
    micro-step, so a step of k micro-batches sends k times;
  - an Adam-like preconditioner after ``compressed_adam``, whose output is
    Adam's direction already.
  """
  if _states_of(inner_state, (optax.MultiStepsState,)):
    raise ValueError(
        "DataParallel.chain(tx): tx holds optax.MultiSteps, which would"
        " accumulate after the compressed exchange, so every micro-step"
        " would send. Accumulate the local gradients instead: add up k"
        " micro-batches' dp.value_and_grad gradients with + (and divide by"
        " k), then call the optimizer once, one compressed send per k"
        " micro-steps."
    )
  if compressor_name != "compressed_adam":
    return
  found = _states_of(inner_state, _PRECONDITIONER_STATES)
  if found:
    raise ValueError(
        "DataParallel.chain(tx): the compressor is compressed_adam, which"
        " returns Adam's direction already, and tx holds"
        f" {type(found[0]).__name__}, a second preconditioner (optax.adam"
        " and its kin) that would rescale it again. Chain what follows"
        " scale_by_adam in optax.adamw instead:"
        " dp.chain(optax.chain(optax.add_decayed_weights(wd),"
        " optax.scale_by_learning_rate(lr)))."
    )


def begin_update(grads: Any, axis_name: str, caller: str) -> int:
  """Checks where an update runs and what it is given; returns the axis size."""
  n = collectives.axis_size(axis_name, caller)
  check_local(grads, axis_name, caller)
  check_not_in_conditional(caller)
  # pylint: disable-next=protected-access
  check_first_in_chain(caller, sys._getframe(2))
  return n
