"""What every compressor shares: its type, its accounting and its checks."""

from collections.abc import Callable, Sequence
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.extend
from jax import lax
import jax.numpy as jnp
import numpy as np
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


# The phase of a compressor's dense warm-up steps.
DENSE = "dense"

# (params or their shapes, axis size) -> {phase name: CommVolume}.
VolumeFn = Callable[[Any, int], dict[str, CommVolume]]
# A compressor's state -> {phase name: the state before that phase's step}.
PhasesFn = Callable[[Any], dict[str, Any]]


def _one_phase(state: Any) -> dict[str, Any]:
  return {"step": state}


class Compressor(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that knows what it communicates.

  It is a plain ``GradientTransformation`` to optax (``optax.chain`` and
  friends take it as is). Beside ``init`` and ``update`` it carries what the
  data-parallel layer and the accounting need to know about it:

  Attributes:
    axis_name: the mapped axis its update communicates over.
    local_fields: names of the state's fields that differ across devices
      (the residuals); every other field is identical on every replica, so
      it is stored once.
    phases: a state (or its abstract shapes) -> ``{phase name: the state
      before that phase's step}``, with the names of ``comm_bytes`` (one
      ``"step"``, or ACP-SGD's ``"p"`` and ``"q"``); for lowering each
      phase's step, so its leaves may be abstract.
    bucket_bytes: at most this many bytes of uncompressed gradient go into
      a bucket, unless a leaf alone is larger (see ``collectives``).
    leaf_order: the order in which the buckets take the leaves (see
      ``collectives.bucket_plan``), or None.
    dependent_rounds: whether a bucket's second round needs its first one's
      result (Power-SGD), which changes the buckets on a CPU.
    cycle: the names of the phases a compressing step runs through, in
      order (``("step",)``, or ACP-SGD's ``("p", "q")``).
    warmup_steps: how many dense steps (S-SGD, phase ``"dense"``) come
      before the first compressed one; see ``at_step``.
    made_by: ``(factory name, {argument: value})``, what made it: recorded
      in a checkpoint so that a restore into another compressor, or the same
      one with other arguments, is refused (``acp_jax.checkpoint``).
  """

  def __new__(
      cls,
      init,
      update,
      volume: VolumeFn,
      *,
      axis_name: str,
      local_fields: Sequence[str] = ("error",),
      phases: PhasesFn = _one_phase,
      bucket_bytes: float = collectives.DEFAULT_BUCKET_BYTES,
      leaf_order: tuple[int, ...] | None = None,
      dependent_rounds: bool = False,
      cycle: Sequence[str] = ("step",),
      warmup_steps: int = 0,
      to_phase: Callable[[Any, bool], Any] | None = None,
      made_by: tuple[str, dict[str, Any]] | None = None,
  ):
    self = super().__new__(cls, init, update)
    self.bucket_bytes = bucket_bytes
    self.leaf_order = leaf_order
    self.dependent_rounds = dependent_rounds
    self._volume = volume
    self.axis_name = axis_name
    self.local_fields = tuple(local_fields)
    self.phases = phases
    self.cycle = tuple(cycle)
    self.warmup_steps = warmup_steps
    self._to_phase = to_phase
    self.made_by = made_by
    return self

  def phase_at(self, step: int) -> str:
    """The phase that step ``step`` (counted from 0) runs: ``"dense"`` during
    the warm-up, then the ``cycle``, starting with its first phase."""
    _check_step(step)
    if step < self.warmup_steps:
      return DENSE
    return self.cycle[(step - self.warmup_steps) % len(self.cycle)]

  def at_step(self, state: Any, step: int) -> Any:
    """``state``, set to run step ``step`` (counted from 0).

    A compressor with ``warmup_steps`` records in its state whether the next
    step is dense, and a jitted step compiles one program for each, neither
    with a collective under a run-time conditional. The training loop calls
    this before every step, with the number of steps taken, and passes on
    what it returns: it switches the state to the dense phase before
    ``warmup_steps`` and out of it from then on (into the cycle's first
    phase), and returns ``state`` itself otherwise, without touching a
    device. Without a warm-up it is the identity.

    At a switch it reads the state's step count (it waits for the last
    step) and follows it: the warm-up ends once the state has taken
    ``warmup_steps`` steps (a step skipped for a non-finite gradient does not
    count), and a switch back into the warm-up of a state past it is
    refused. A dense step run after the warm-up (this call forgotten, or its
    result dropped) raises when it runs; a warm-up state given to a
    compressor without ``warmup_steps`` is refused when the step is traced.

    ``state`` may be stacked on a leading device axis, as ``jax.pmap`` keeps
    it. A ``jax.pmap`` loop with a warm-up, the compressor first in its
    chain (so ``state[0]`` is the compressor's state)::

      compressor = acp_jax.acp_sgd(4, warmup_steps=100)
      tx = optax.chain(compressor, optax.sgd(0.1))
      state = jax.pmap(tx.init, axis_name="data")(stacked_params)
      for step in range(num_steps):
        state = (compressor.at_step(state[0], step), *state[1:])
        params, state = pmapped_step(params, state, batch(step))
    """
    _check_step(step)
    if not self.warmup_steps:
      return state
    if not all(hasattr(state, f) for f in ("phase", "count")):
      raise TypeError(
          "at_step takes this compressor's own state, got a"
          f" {type(state).__name__}: for optax.chain(compressor, ...), pass"
          " state[0] and put the result back; with DataParallel, call"
          " dp.at_step(opt_state, step)."
      )
    dense = self.phase_at(step) == DENSE
    switched = self._to_phase(state, dense)
    if switched is state:
      return state
    taken = _steps_taken(state)
    if taken is None:  # abstract: nothing to read
      return switched
    if dense and taken >= self.warmup_steps:
      raise ValueError(
          f"at_step(state, {step}): step {step} is in the dense warm-up"
          f" (warmup_steps={self.warmup_steps}), but the state has taken"
          f" {taken} steps, past it. Pass the number of steps taken so far"
          f" ({taken} here), counted from 0."
      )
    if not dense and taken < self.warmup_steps:
      # The state is behind the loop's count (steps skipped for non-finite
      # gradients, or a step counted from 1): its warm-up is not over yet.
      return state
    return switched

  def buckets(self, params: Any) -> collectives.BucketPlan:
    """The buckets in which ``update`` sends the gradients of ``params``
    (or of their shapes): tuples of indices into ``jax.tree.leaves(params)``,
    in the order they are sent (``leaf_order``, else the last leaf first)."""
    plan = collectives.leaf_plan(
        jax.tree.leaves(params), self.bucket_bytes, self.leaf_order
    )
    if self.dependent_rounds:
      return collectives.for_dependent_rounds(plan)
    return plan


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


def _steps_taken(state: Any) -> int | None:
  """The step count of a state (its ``count``; the first device's when
  stacked on device axes), read from the device; None when abstract."""
  count = state.count
  if not isinstance(count, jax.Array):
    return None
  first = count.addressable_shards[0].data
  return int(np.asarray(jax.device_get(first)).ravel()[0])


def _check_step(step: Any) -> None:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}")


def check_comm_dtype(comm_dtype: Any) -> None:
  """Raises unless ``comm_dtype`` is None or a floating dtype."""
  if comm_dtype is None:
    return
  try:
    floating = jnp.issubdtype(comm_dtype, jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise ValueError(
        f"comm_dtype must be a floating dtype or None, got {comm_dtype!r}"
    )


def check_float_leaves(params: Any, caller: str) -> None:
  """Raises if a leaf is not a real floating-point array, or if some leaves
  were masked away from the compressor."""
  if any(is_masked(x) for x in jax.tree.leaves(params, is_leaf=is_masked)):
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


def check_state(state: Any, expected: type, caller: str) -> None:
  """Raises unless ``state`` is of the type ``caller``'s init makes."""
  if not isinstance(state, expected):
    raise TypeError(
        f"{caller} was given a {type(state).__name__}, not the"
        f" {expected.__name__} its init makes: the state comes from another"
        " compressor. Init and update must come from the same factory call"
        " (after a change of compressor, start from a fresh init)."
    )


def check_static(caller: str, **args: Any) -> None:
  """Raises if a factory argument that fixes shapes arrived as an array.

  ``optax.inject_hyperparams`` turns numeric arguments into arrays; these
  ones decide what is sent (ranks, k), so they must stay Python numbers.
  """
  arrays = [k for k, v in args.items() if isinstance(v, (jax.Array, np.ndarray))]
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


# Collectives whose result is the same on every device of their axes.
_REDUCING = frozenset(
    ("psum", "psum_invariant", "pmax", "pmin", "all_gather",
     "all_gather_invariant")
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
  finiteness. JAX offers no query for this, so the Python stack is read;
  it runs only while tracing.
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


def begin_update(grads: Any, axis_name: str, caller: str) -> int:
  """Checks where an update runs and what it is given; returns the axis size."""
  n = collectives.axis_size(axis_name, caller)
  check_local(grads, axis_name, caller)
  check_not_in_conditional(caller)
  # pylint: disable-next=protected-access
  check_first_in_chain(caller, sys._getframe(2))
  return n
