"""The checks of the compressors' arguments and of where their updates run.

Factories call ``factory_args``, updates ``begin_update`` (at trace time);
every check a compressor makes lives here, once.
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import contextvars
import math
import os
from typing import Any, NamedTuple
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import _dataflow
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
  """``value``; raises unless it is None or a floating dtype. Warns of a
  narrower exponent than float32's (float16): sums past its max are inf."""
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
  """``value`` as a tuple or None; raises unless None or distinct ints >= 0."""
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
    "seed": lambda v, _: integer("seed", v, 0, numpy=True),
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
  """A factory's arguments, checked in order, with None resolved
  (``bucket_bytes``: 25 MiB, ``warmup_steps``: 0) and ``leaf_order`` a tuple;
  one no rule knows is returned as it is, for its factory to check. Raises
  ``ValueError`` naming the argument, the value and the fix."""
  _check_static(caller, {k: v for k, v in args.items() if k in _STATIC})
  unchecked = lambda v, _: v
  return {
      name: _RULES.get(name, unchecked)(value, caller)
      for name, value in args.items()
  }


class Bucketed(NamedTuple):
  """The checked arguments of a factory that sends its leaves in buckets."""

  caller: str  # the factory's name
  axis_name: str
  bucket_bytes: float  # None resolved to buckets.DEFAULT_BUCKET_BYTES
  leaf_order: tuple[int, ...] | None
  own: dict[str, Any]  # its other arguments


def bucketed_args(
    caller: str, axis_name: str, bucket_bytes: Any, leaf_order: Any, **own
) -> Bucketed:
  """``factory_args`` of a factory that sends its leaves in buckets."""
  args = factory_args(
      caller, **own, bucket_bytes=bucket_bytes, leaf_order=leaf_order
  )
  return Bucketed(
      caller,
      axis_name,
      args.pop("bucket_bytes"),
      args.pop("leaf_order"),
      args,
  )


def _check_static(caller: str, args: dict[str, Any]) -> None:
  """Raises if an argument that fixes what is sent (ranks, k) arrived as an
  array, as ``optax.inject_hyperparams`` makes numeric arguments."""
  arrays = [
      k for k, v in args.items() if isinstance(v, (jax.Array, np.ndarray))
  ]
  if arrays:
    names = ", ".join(repr(k) for k in arrays)
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
  """Raises unless ``grads`` has the structure and shapes of ``state_tree``."""
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
  """Mapped axes over which ``x`` may differ, if JAX tracks them here: its
  type's ``vma`` (jax 0.6) or ``manual_axis_type.varying`` (0.10), as no
  public call gives them. Should both go,
  ``tests/test_errors.py::test_gradients_already_reduced_by_grad`` fails."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return aval.manual_axis_type.varying
  return getattr(aval, "vma", None)


def varying_outputs(
    fun: Callable[..., Any], args: tuple, varying: list[bool], axes: tuple
) -> list[bool]:
  """For each output leaf of ``fun(*args)`` (traced where ``axes`` are
  bound), whether it provably depends on an argument flagged in ``varying``
  or on the device index through no reducing collective over ``axes``. What
  its jaxpr hides (``lax.cond``, ``lax.scan``) counts as alike on every
  device: it errs only towards not raising."""
  jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
  return _dataflow.flow(jaxpr, varying, opaque=False, reduced_over=axes)[0]


def check_local(grads: Any, axis_name: str, caller: str) -> None:
  """Raises if every gradient is provably identical across ``axis_name``.

  Under ``jax.shard_map`` (check_vma=True), ``jax.grad`` of replicated params
  all-reduces densely by itself, and the compressor would add its traffic on
  top. Unchecked where JAX tracks no varying axes (``jax.pmap``,
  ``check_vma=False``)."""
  leaves = jax.tree.leaves(grads)
  varying = _varying_axes(lax.axis_index(axis_name)) or ()
  if not leaves or axis_name not in varying:
    return
  if not any(axis_name in _varying_axes(g) for g in leaves):
    raise ValueError(
        f"{caller}: the gradients are already identical across axis"
        f" {axis_name!r}, so jax.grad all-reduced them densely before the"
        " compressor saw them (it does so for params replicated under"
        " jax.shard_map). Differentiate with respect to"
        f" jax.lax.pcast(params, {axis_name!r}, to='varying') so each"
        " device hands over its own gradient."
    )


# Set to 1 (read when a step is traced) for the placement checks that cost
# something: an update refuses to run outside a composition that puts it
# first (``acp_jax.chain``, ``DataParallel``), as optax tells a transform
# nothing of its place in a chain; and where JAX tracks no varying axes, the
# step checks at run time, with two collectives more, that the gradients
# differ across devices (so identical batches on every device raise too).
DEBUG_PLACEMENT = "ACP_JAX_DEBUG_PLACEMENT"
# Whether a placing composition runs the update: a context variable, since
# optax's ``update(grads, state, params)`` has no argument for it.
_PLACED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "placed", default=False
)


@contextlib.contextmanager
def placed() -> Iterator[None]:
  """Marks the compressor updates run within it as placed first, where
  everything after them sees the mean (``check_placement``)."""
  token = _PLACED.set(True)
  try:
    yield
  finally:
    _PLACED.reset(token)


class PlacementWarning(UserWarning):
  """A compressor's update ran where nothing shows its place in a chain."""


def check_placement(grads: Any, axis_name: str, caller: str) -> None:
  """Checks that the update runs in a placing composition: as
  ``DEBUG_PLACEMENT`` describes where it is set, else by a warning where JAX
  tracks no varying axes (``jax.pmap``, ``jax.vmap``, ``check_vma=False``)."""
  debug = os.environ.get(DEBUG_PLACEMENT) == "1"
  tracked = axis_name in (_varying_axes(lax.axis_index(axis_name)) or ())
  if not _PLACED.get():
    if debug:
      raise ValueError(
          f"{caller}'s update ran outside acp_jax.chain and DataParallel"
          f" ({DEBUG_PLACEMENT}=1): in an optax.chain after another"
          " transform, that transform would see each device's own gradient,"
          " not the mean (Adam's moments, a clipping norm computed per"
          f" device). Compose with acp_jax.chain({caller}(...),"
          " optax.adam(...)), which puts the compressor first, or with"
          " DataParallel.chain."
      )
    if not tracked:
      warnings.warn(
          f"{caller}'s update ran outside acp_jax.chain and DataParallel"
          " where JAX tracks no varying axes (jax.pmap, jax.vmap,"
          " shard_map with check_vma=False), so nothing shows that it comes"
          " first: after another transform in an optax.chain (optax.adam),"
          " it would average that transform's per-device output, not the"
          f" gradients. Compose with acp_jax.chain({caller}(...), ...),"
          " which puts it first and says nothing, or set"
          f" {DEBUG_PLACEMENT}=1 to refuse such updates.",
          PlacementWarning,
      )
  leaves = jax.tree.leaves(grads)
  if not debug or tracked or not leaves or lax.axis_size(axis_name) == 1:
    return
  spread = sum(
      jnp.sum(lax.pmax(g, axis_name) - lax.pmin(g, axis_name)) for g in leaves
  )

  def check(spread):
    if spread == 0:
      raise ValueError(
          f"{caller}: the gradients are the same on every device of axis"
          f" {axis_name!r} ({DEBUG_PLACEMENT}=1): averaged before the"
          " compressor (by lax.pmean, lax.psum or an all-gather), the step"
          " sends them densely and then compressed. Hand the compressor"
          " each device's own gradient, not its mean: its update returns"
          " the mean."
      )

  jax.debug.callback(check, spread)


def _states_of(tree: Any, types: tuple[type, ...]) -> list[Any]:
  return [
      x
      for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
      if isinstance(x, types)
  ]


def check_descends(
    tx: optax.GradientTransformation, params: Any, where: str
) -> bool:
  """Raises if ``tx``'s update of a gradient of ones is not finite, or
  climbs in every leaf that moves (one that ``optax.masked`` passes through
  climbs anyway): a NaN, infinite or negative learning rate, hidden in
  optax's closures. The probe, one element per leaf at params of zero, runs
  even under a trace. Returns whether it ran: not for a ``tx`` that needs
  extra arguments, or the params' tree where ``params`` is None."""
  params = jnp.zeros((1, 1)) if params is None else params
  try:
    with jax.ensure_compile_time_eval():
      zeros = jax.tree.map(lambda x: jnp.zeros((1,) * jnp.ndim(x)), params)
      ones = jax.tree.map(jnp.ones_like, zeros)
      updates, _ = tx.update(ones, tx.init(zeros), zeros)
      slopes = [float(jnp.sum(u)) for u in jax.tree.leaves(updates)]
  except Exception:  # pylint: disable=broad-except
    # A wrong tree or shape, or missing arguments: the step reports them.
    return False
  bad = next((s for s in slopes if not math.isfinite(s)), None)
  if bad is not None:
    raise ValueError(
        f"{where}: the optimizer's update of a gradient of ones is {bad}:"
        " its learning rate is NaN or infinite (e.g. optax.sgd(float('nan'))),"
        " which turns every param NaN; give it a finite one"
    )
  if max(slopes, default=0.0) > 0 and min(slopes) >= 0:
    raise ValueError(
        f"{where}: the optimizer's update of a gradient of ones is"
        f" {max(slopes):+.3g}, along the gradient: its learning rate is"
        " negative (e.g. optax.sgd(-0.5)), which climbs the loss; give it a"
        " positive one"
    )
  return True


def check_optimizer_after(inner_state: Any, where: str) -> None:
  """Raises if the optimizer after the compressor holds ``optax.MultiSteps``
  (its state's type shows it, however deeply chained): the exchange runs
  before it at every micro-step, so k micro-batches would send k times."""
  if not _states_of(inner_state, (optax.MultiStepsState,)):
    return
  if where.startswith("DataParallel"):
    instead = (
        "add up k micro-batches' dp.value_and_grad gradients with + (and"
        " divide by k), then call the optimizer once"
    )
  else:
    instead = (
        "add up k micro-batches' gradients on each device (and divide by"
        " k), then call its update once"
    )
  raise ValueError(
      f"{where}: the optimizer holds optax.MultiSteps, which would"
      " accumulate after the compressed exchange, so every micro-step would"
      f" send. Accumulate before the compressor instead: {instead}, one"
      " compressed send per k micro-steps."
  )


def begin_update(grads: Any, axis_name: str, caller: str) -> int:
  """Checks where an update runs and what it is given; returns the axis size."""
  n = collectives.axis_size(axis_name, caller)
  check_local(grads, axis_name, caller)
  check_placement(grads, axis_name, caller)
  return n
