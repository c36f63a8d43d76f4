"""What every compressor shares: its type and its accounting."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
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
      times what it contributes, its own part included), which is the size of
      the gathered result.
  """

  all_reduce: int = 0
  all_gather: int = 0

  @property
  def total(self) -> int:
    return self.all_reduce + self.all_gather


# The phase of a compressor's dense warm-up steps.
DENSE = phase_lib.Phase.DENSE.value

# (params or their shapes, axis size) -> {phase name: CommVolume}.
VolumeFn = Callable[[Any, int], dict[str, CommVolume]]
# A compressor's state -> {phase name: the state before that phase's step}.
PhasesFn = Callable[[Any], dict[str, Any]]


def _one_phase(state: Any) -> dict[str, Any]:
  return {phase_lib.STEP: state}


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
      ``buckets.bucket_plan``), or None.
    packed_rounds: whether each round goes packed into buffers, which
      puts every leaf in one bucket on a CPU (``buckets.for_packed_rounds``):
      True (Power-SGD), or a function of nothing that says it at trace time
      (ACP-SGD: ``collectives.network_sends_each_operand``).
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
      bucket_bytes: float = buckets.DEFAULT_BUCKET_BYTES,
      leaf_order: tuple[int, ...] | None = None,
      packed_rounds: bool | Callable[[], bool] = False,
      cycle: Sequence[str] = (phase_lib.STEP,),
      warmup_steps: int = 0,
      to_phase: Callable[[Any, bool], Any] | None = None,
      made_by: tuple[str, dict[str, Any]] | None = None,
  ):
    self = super().__new__(cls, init, update)
    self.bucket_bytes = bucket_bytes
    self.leaf_order = leaf_order
    self.packed_rounds = packed_rounds
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
    _checks.integer("step", step, 0, numpy=True)
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
    _checks.integer("step", step, 0, numpy=True)
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

  def buckets(self, params: Any) -> buckets.BucketPlan:
    """The buckets in which ``update`` sends the gradients of ``params``
    (or of their shapes): tuples of indices into ``jax.tree.leaves(params)``,
    in the order they are sent (``leaf_order``, else the last leaf first)."""
    plan = buckets.leaf_plan(
        jax.tree.leaves(params), self.bucket_bytes, self.leaf_order
    )
    packed = self.packed_rounds
    if packed() if callable(packed) else packed:
      return buckets.for_packed_rounds(plan)
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
  _checks.integer("num_devices", num_devices, 1)
  return compressor._volume(params, num_devices)


def _steps_taken(state: Any) -> int | None:
  """The step count of a state (its ``count``; the first device's when
  stacked on device axes), read from the device; None when abstract."""
  count = state.count
  if not isinstance(count, jax.Array):
    return None
  first = count.addressable_shards[0].data
  return int(np.asarray(jax.device_get(first)).ravel()[0])


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
