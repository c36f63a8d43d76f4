"""What every compressor shares: its type and its accounting."""

from collections.abc import Callable, Sequence
import copy
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acp_jax import _checks
from acp_jax import buckets
from acp_jax import phase as phase_lib


class CommVolume(NamedTuple):
  """Bytes that one step moves, per device.

  Attributes:
    all_reduce: size of the buffers each device contributes to all-reduces.
    all_gather: bytes each device receives from all-gathers (the axis size
      times its contribution): the size of the gathered result.
  """

  all_reduce: int = 0
  all_gather: int = 0

  @property
  def total(self) -> int:
    return self.all_reduce + self.all_gather


# (params or their shapes, axis size) -> {phase name: CommVolume}.
VolumeFn = Callable[[Any, int], dict[str, CommVolume]]
# A compressor's state -> {phase name: the state before that phase's step}.
PhasesFn = Callable[[Any], dict[str, Any]]


def _one_phase(state: Any) -> dict[str, Any]:
  return {phase_lib.STEP: state}


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the data-parallel layer and the accounting need to know about a
  compressor, beside its ``init`` and ``update``.

  Attributes:
    volume: the bytes one step sends per device, by phase (``comm_bytes``).
    axis_name: the mapped axis its update communicates over.
    local_fields: the state's fields that differ across devices (the
      residuals); every other field is stored once.
    phases: a state (or its shapes) -> ``{phase name: the state before that
      phase's step}``, for lowering each phase's step.
    bucket_bytes: at most this many bytes of uncompressed gradient go into
      a bucket, unless a leaf alone is larger (see ``collectives``).
    leaf_order: the order in which the buckets take the leaves, or None.
    packed_rounds: whether each round goes packed into buffers, every leaf
      in one bucket on a CPU: True (Power-SGD), or a function of nothing
      that says it at trace time (ACP-SGD).
    cycle: the phases a compressing step runs through, in order
      (``("step",)``, or ACP-SGD's ``("p", "q")``).
    warmup_steps: how many dense steps (phase ``"dense"``) come before the
      first compressed one; see ``Compressor.at_step``.
    to_phase: ``(state, dense) -> state`` switched into the dense phase or
      out of it (``phase.switch_to``); None without a warm-up.
    made_by: ``(factory name, {argument: value})``: recorded in a
      checkpoint so that a restore into another compressor is refused, and
      what a pickled compressor is made again from (``acp_jax.registry``).
  """

  volume: VolumeFn
  axis_name: str
  local_fields: tuple[str, ...] = ("error",)
  phases: PhasesFn = _one_phase
  bucket_bytes: float = buckets.DEFAULT_BUCKET_BYTES
  leaf_order: tuple[int, ...] | None = None
  packed_rounds: bool | Callable[[], bool] = False
  cycle: tuple[str, ...] = (phase_lib.STEP,)
  warmup_steps: int = 0
  to_phase: Callable[[Any, bool], Any] | None = None
  made_by: tuple[str, dict[str, Any]] | None = dataclasses.field(
      default=None, hash=False
  )

  def __post_init__(self):
    object.__setattr__(self, "local_fields", tuple(self.local_fields))
    object.__setattr__(self, "cycle", tuple(self.cycle))


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(Spec))
# Settings the update closes over: ``_replace`` remakes the compressor
# through its factory to change them, or refuses.
_CAPTURED = ("axis_name", "bucket_bytes", "leaf_order")


class Compressor(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that knows what it communicates.

  To optax it is the plain pair ``(init, update)``. Beside it, ``spec`` (a
  frozen ``Spec``) holds the settings that the data-parallel layer and the
  accounting read, each also an attribute (``compressor.cycle``).

  It is immutable. ``_replace`` takes ``init``, ``update`` and any field of
  ``Spec``. A change of an argument that ``made_by`` records makes the
  compressor again through its factory; a change of ``axis_name``,
  ``bucket_bytes`` or ``leaf_order`` otherwise, which the update closes
  over, is refused unless ``init`` or ``update`` come with it. Any other
  change drops ``made_by`` unless it is given too. Compressors made by a
  factory are equal when ``made_by`` is, pickle as it, and print as the
  call that made them; others are equal when their functions and ``spec``
  are, and do not pickle.
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
      bucket_bytes: float = buckets.DEFAULT_BUCKET_BYTES,
      leaf_order: tuple[int, ...] | None = None,
      packed_rounds: bool | Callable[[], bool] = False,
      cycle: Sequence[str] = (phase_lib.STEP,),
      warmup_steps: int = 0,
      to_phase: Callable[[Any, bool], Any] | None = None,
      made_by: tuple[str, dict[str, Any]] | None = None,
  ):
    spec = Spec(
        volume,
        axis_name,
        local_fields,
        phases,
        bucket_bytes,
        leaf_order,
        packed_rounds,
        cycle,
        warmup_steps,
        to_phase,
        made_by,
    )
    return cls.from_spec(init, update, spec)

  @classmethod
  def from_spec(cls, init, update, spec: Spec) -> "Compressor":
    """The compressor of ``init``, ``update`` and ``spec``."""
    self = super().__new__(cls, init, update)
    object.__setattr__(self, "spec", spec)
    return self

  def __getattr__(self, name: str) -> Any:
    # Reached only for names not found otherwise: the settings.
    if name in _SPEC_FIELDS and "spec" in self.__dict__:
      return getattr(self.spec, name)
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}"
    )

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f"Compressor is immutable: use compressor._replace({name}=...)"
    )

  def _replace(self, **changes: Any) -> "Compressor":
    init = changes.pop("init", self.init)
    update = changes.pop("update", self.update)
    spec = dataclasses.replace(self.spec, **changes)
    new_functions = init is not self.init or update is not self.update
    changes = {
        k: v for k, v in changes.items() if v is not getattr(self.spec, k)
    }
    if not new_functions and "made_by" not in changes:
      args = self.made_by[1] if self.made_by else {}
      made = {k: v for k, v in changes.items() if k in args}
      if made:  # the factory's own arguments: made again with them
        remade = _remade((self.made_by[0], {**args, **made}))
        rest = {k: v for k, v in changes.items() if k not in made}
        return remade._replace(**rest) if rest else remade
      captured = [k for k in _CAPTURED if k in changes]
      if captured:
        name = captured[0]
        factory = f"acp_jax.{self.made_by[0]}" if self.made_by else "factory"
        raise ValueError(
            f"_replace({name}=...) cannot change {name}: the compressor's"
            " update took it from its factory when it was made. Make the"
            f" compressor again with it, {factory}(..., {name}="
            f"{changes[name]!r})"
        )
    if (new_functions or changes) and "made_by" not in changes:
      spec = dataclasses.replace(spec, made_by=None)
    return self.from_spec(init, update, spec)

  def __copy__(self) -> "Compressor":
    return self.from_spec(self.init, self.update, self.spec)

  def __deepcopy__(self, memo: dict) -> "Compressor":
    spec = copy.deepcopy(self.spec, memo)
    return self.from_spec(self.init, self.update, spec)

  def __reduce__(self):
    if self.made_by is None:
      raise TypeError(
          "a Compressor not made by a registered factory (made_by=None) does"
          " not pickle: its functions do not. Pickle the factory's name and"
          " arguments instead."
      )
    return _remade, (self.made_by,)

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, Compressor):
      return NotImplemented
    if self.made_by is not None or other.made_by is not None:
      return self.made_by == other.made_by
    return tuple(self) == tuple(other) and self.spec == other.spec

  def __repr__(self) -> str:
    """The call that made it, every argument in the factory's order; else
    its functions and settings."""
    if self.made_by is not None:
      name, args = self.made_by
      shown = ", ".join(f"{k}={_shown(v)}" for k, v in args.items())
      return f"{name}({shown})"
    return (
        f"Compressor(init={_shown(self.init)},"
        f" update={_shown(self.update)}, axis_name={self.axis_name!r},"
        f" cycle={tuple(self.cycle)!r}, warmup_steps={self.warmup_steps!r})"
    )

  def __ne__(self, other: Any) -> bool:
    equal = self.__eq__(other)
    return equal if equal is NotImplemented else not equal

  def __hash__(self) -> int:
    if self.made_by is not None:
      return hash(self.made_by[0])
    return hash((tuple(self), self.spec))

  def phase_at(self, step: int) -> str:
    """The phase that step ``step`` (counted from 0) runs: ``"dense"`` during
    the warm-up, then the ``cycle``, starting with its first phase."""
    return phase_lib.phase_at(step, self.warmup_steps, self.cycle)

  def at_step(self, state: Any, step: int) -> Any:
    """``state``, set to run step ``step`` (counted from 0).

    A compressor with ``warmup_steps`` records in its state whether the next
    step is dense, so that a jitted step compiles one program for each, with
    no collective under a run-time conditional. Call this before every
    step, with the number of steps taken, and pass on what it returns.
    Without a warm-up it is the identity.

    At a switch it reads the state's step count (waiting for the last step)
    and follows it: the warm-up ends once the state has taken
    ``warmup_steps`` steps (skipped steps do not count), and a switch back
    into it is refused. A dense step run after the warm-up raises when it
    runs; a warm-up state given to a compressor without ``warmup_steps``,
    when traced.

    ``state`` may be stacked on a leading device axis, as ``jax.pmap`` keeps
    it. A ``jax.pmap`` loop with a warm-up, the compressor first in its
    chain::

      compressor = acp_jax.acp_sgd(4, warmup_steps=100)
      tx = acp_jax.chain(compressor, optax.sgd(0.1))
      state = jax.pmap(tx.init, axis_name="data")(stacked_params)
      for step in range(num_steps):
        state = (compressor.at_step(state[0], step), *state[1:])
        params, state = pmapped_step(params, state, batch(step))
    """
    return phase_lib.at_step(
        state, step, self.warmup_steps, self.cycle, self.to_phase
    )

  def buckets(self, params: Any) -> buckets.BucketPlan:
    """The buckets in which ``update`` sends the gradients of ``params``:
    tuples of leaf indices, in the order they are sent."""
    plan = buckets.leaf_plan(
        jax.tree.leaves(params), self.bucket_bytes, self.leaf_order
    )
    packed = self.packed_rounds
    if packed() if callable(packed) else packed:
      return buckets.for_packed_rounds(plan)
    return plan


def from_parts(
    args: _checks.Bucketed,
    state_type: type,
    init: Callable[[Any], Any],
    update: Callable[[Any, Any], tuple[Any, Any]],
    volume: VolumeFn,
    local_fields: Sequence[str] = ("error",),
) -> Compressor:
  """The compressor of a factory that sends its leaves in buckets (S-SGD,
  Sign-SGD, Top-k), from its checked ``args``, its ``init(params)`` and
  ``update(updates, state)``, here wrapped with the input checks.
  ``made_by`` records ``args.own`` with the axis, bucket size and order."""
  name, axis_name = args.caller, args.axis_name

  def init_fn(params):
    _checks.check_float_leaves(params, name)
    return init(params)

  def update_fn(updates, state, params=None):
    del params
    _checks.begin_update(updates, axis_name, name)
    _checks.check_state(state, state_type, name)
    return update(updates, state)

  made_by = dict(
      args.own,
      axis_name=axis_name,
      bucket_bytes=args.bucket_bytes,
      leaf_order=args.leaf_order,
  )
  spec = Spec(
      volume,
      axis_name,
      local_fields,
      bucket_bytes=args.bucket_bytes,
      leaf_order=args.leaf_order,
      made_by=(name, made_by),
  )
  return Compressor.from_spec(init_fn, update_fn, spec)


def plain_setting(value: Any) -> Any:
  """``value`` as JSON that compares equal exactly when the setting does:
  dtypes by name, functions by qualified name, NumPy scalars as the Python
  scalars of their value."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, dict):
    return {str(k): plain_setting(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain_setting(v) for v in value]
  try:
    return str(jnp.dtype(value))
  except TypeError:
    pass
  if hasattr(value, "__qualname__"):  # repr would hold its address
    return f"{value.__module__}.{value.__qualname__}"
  return repr(value)


def _shown(value: Any) -> str:
  """A setting as ``__repr__`` writes it."""
  if value is None or isinstance(value, (bool, int, float, str, tuple, list)):
    return repr(value)
  return repr(plain_setting(value))


# The factory of each registered compressor, by name: ``registry.register``
# adds to it (the registry imports the factories, which import this module).
FACTORIES: dict[str, Callable[..., "Compressor"]] = {}


def _remade(made_by: tuple[str, dict[str, Any]]) -> Compressor:
  """The compressor ``made_by`` says, made again by its registered factory
  (what a pickled compressor is)."""
  name, args = made_by
  if name not in FACTORIES:
    raise ValueError(
        f"no compressor named {name!r} is registered (registered:"
        f" {', '.join(FACTORIES)}): register it (acp_jax.registry.register)"
        " before making it again from what made it"
    )
  return FACTORIES[name](**args)


def chain(
    compressor: Compressor, *transforms: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(compressor, *transforms)``, the compressor first, for a
  loop of one's own under ``jax.shard_map`` or ``jax.pmap``.

  Everything after the compressor (clipping, weight decay, Adam's moments)
  sees the mean gradient it returns; the state is ``optax.chain``'s. Where
  JAX tracks no varying axes (``jax.pmap``, ``jax.vmap``, ``shard_map``
  with ``check_vma=False``), a compressor's update run by neither this nor
  ``DataParallel`` warns once with a ``PlacementWarning``: nothing there
  shows that it comes first.

  Example::

    tx = acp_jax.chain(acp_jax.power_sgd(rank=4), optax.sgd(0.1))
    # in the mapped step, with this device's gradients:
    updates, state = tx.update(grads, state, params)

  Args:
    compressor: a ``Compressor``, from a factory or one's own.
    *transforms: the optax transforms that follow it; none a compressor,
      none holding ``optax.MultiSteps`` (refused by ``init``: the exchange
      would send at every micro-step), none with a NaN, infinite or
      negative learning rate.

  Returns:
    The chained transformation.
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(
        "acp_jax.chain takes a compressor first (acp_jax.acp_sgd(...) and"
        f" its kin), got {type(compressor).__name__}"
    )
  for i, tx in enumerate(transforms, 1):
    if isinstance(tx, Compressor):
      raise ValueError(
          f"acp_jax.chain: transform {i} is a compressor too"
          f" ({(tx.made_by or ('a Compressor',))[0]}); a step averages its"
          " gradients once, with the first."
      )
  rest = optax.chain(*transforms)
  where = "acp_jax.chain"
  probed = _checks.check_descends(rest, None, where)

  def init_fn(params):
    if not probed:
      _checks.check_descends(rest, params, where)
    others = rest.init(params)
    _checks.check_optimizer_after(others, where)
    return (compressor.init(params), *others)

  def update_fn(updates, state, params=None, **extra_args):
    _checks.check_optimizer_after(state[1:], where)
    with _checks.placed():
      mean, first = compressor.update(updates, state[0], params)
    updates, others = rest.update(mean, state[1:], params, **extra_args)
    return updates, (first, *others)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
  _checks.integer("num_devices", num_devices, 1)
  return compressor.volume(params, num_devices)


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
