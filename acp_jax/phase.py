"""The phase of a low-rank compressor, recorded in the shape of its state's
``phase`` array (the marker).

The shape is static to jit, which compiles one variant per phase, each with
only its own all-reduce: no collective sits inside a run-time conditional.
Being an array, the marker survives every path that keeps only array values
(``nnx.Optimizer``, orbax), and paths that need a fixed state type
(``lax.scan`` carries, ``lax.cond``) refuse it when tracing. Orbax cannot
save zero-size arrays, hence sizes from 1. Each phase has a rank of its
own, (1,), (2, 2), (3, 3, 3): a plain orbax restore into a target of another
phase then fails even with strict=False, which pads or truncates within a
rank. This module is the one place that reads a marker's shape.
"""

from collections.abc import Callable, Sequence
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from acp_jax import _checks

# The name of a single-phase compressor's one step (Power-SGD's computes and
# all-reduces both factors while its state holds the P marker).
STEP = "step"


class Phase(enum.Enum):
  """What a low-rank compressor's next step does: all-reduce the P factors
  (Power-SGD's one compressing phase, ACP-SGD's P-step), the Q factors
  (ACP-SGD's Q-step), or, during a warm-up, S-SGD's dense all-reduce."""

  P = "p"
  Q = "q"
  DENSE = "dense"


DENSE = Phase.DENSE.value

_SHAPE = {Phase.P: (1,), Phase.Q: (2, 2), Phase.DENSE: (3, 3, 3)}
_DTYPE = jnp.uint8


def marker(phase: Phase) -> jax.Array:
  """The array whose shape records ``phase`` in a low-rank state."""
  return jnp.zeros(_SHAPE[phase], _DTYPE)


def phase_of(marker_: Any) -> Phase:
  """The phase that a state's ``phase`` array (or its abstract shape)
  records, in its trailing axes if stacked (a ``jax.pmap``-ed state)."""
  return _phase_and_lead(marker_)[0]


def _phase_and_lead(marker_: Any) -> tuple[Phase, tuple[int, ...]]:
  """The phase a marker records and its leading (device) axes."""
  shape = tuple(marker_.shape)
  for phase, own in _SHAPE.items():
    if shape[len(shape) - len(own) :] == own:
      return phase, shape[: len(shape) - len(own)]
  shapes = ", ".join(map(str, _SHAPE.values()))
  raise ValueError(
      f"a low-rank compressor's phase marker has one of the shapes {shapes}"
      f" (after any leading device axes), got {marker_.shape}"
  )


def is_marker(dtype: Any, shape: tuple[int, ...]) -> bool:
  """Whether an array of this dtype and shape (unstacked) can be a marker."""
  return str(dtype) == jnp.dtype(_DTYPE).name and tuple(shape) in set(
      _SHAPE.values()
  )


def next_marker(marker_: jax.Array, phase: Phase) -> jax.Array:
  """The marker of ``phase``, inside a step, made from the old marker so
  that the step always reads one of its inputs (a shard_map whose inputs
  are all unused or empty fails to compile under Shardy, jax 0.10.2)."""
  return jnp.broadcast_to(marker_.reshape(-1)[0], _SHAPE[phase])


# Older jax's sharding of a jax.pmap-ed array, which jit takes as no
# out_shardings and which holds the array's rank; newer jax has none.
_PMAP_SHARDING = getattr(jax.sharding, "PmapSharding", ())


def marker_as(marker_: Any, phase: Phase) -> Any:
  """The marker of ``phase`` where ``marker_`` lives, outside a step, with
  its leading device axes: abstract for an abstract marker, else made on
  ``marker_``'s devices with its sharding (across processes and for
  ``jax.pmap``-ed states too)."""
  lead = _phase_and_lead(marker_)[1]
  own = _SHAPE[phase]
  shape = lead + own
  if tuple(marker_.shape) == shape:
    return marker_
  sharding = getattr(marker_, "sharding", None)
  if isinstance(marker_, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, _DTYPE, sharding=sharding)
  made = jax.jit(
      lambda m: jnp.broadcast_to(
          m.reshape(lead + (-1,))[..., :1].reshape(lead + (1,) * len(own)),
          shape,
      ),
      out_shardings=(
          sharding
          if isinstance(marker_, jax.Array)
          and not isinstance(sharding, _PMAP_SHARDING)
          else None
      ),
  )(marker_)
  if isinstance(sharding, _PMAP_SHARDING):
    return jax.device_put(
        made, _PMAP_SHARDING.default(shape, 0, list(sharding.devices))
    )
  return made


def phase_at(step: int, warmup_steps: int, cycle: Sequence[str]) -> str:
  """The phase that step ``step`` (counted from 0) runs: ``"dense"`` during
  the first ``warmup_steps``, then ``cycle``'s, starting with its first."""
  _checks.integer("step", step, 0, numpy=True)
  if step < warmup_steps:
    return DENSE
  return cycle[(step - warmup_steps) % len(cycle)]


def at_step(
    state: Any,
    step: int,
    warmup_steps: int,
    cycle: Sequence[str],
    to_phase: Callable[[Any, bool], Any] | None,
) -> Any:
  """``Compressor.at_step``: ``state`` switched by ``to_phase`` into the
  dense phase before ``warmup_steps`` and out of it from then on, as the
  state's own step count allows; ``state`` itself without a warm-up."""
  _checks.integer("step", step, 0, numpy=True)
  if not warmup_steps:
    return state
  if not all(hasattr(state, f) for f in ("phase", "count")):
    raise TypeError(
        "at_step takes this compressor's own state, got a"
        f" {type(state).__name__}: for optax.chain(compressor, ...), pass"
        " state[0] and put the result back; with DataParallel, call"
        " dp.at_step(opt_state, step)."
    )
  dense = phase_at(step, warmup_steps, cycle) == DENSE
  switched = to_phase(state, dense)
  if switched is state:
    return state
  taken = _steps_taken(state)
  if taken is None:  # abstract: nothing to read
    return switched
  if dense and taken >= warmup_steps:
    raise ValueError(
        f"at_step(state, {step}): step {step} is in the dense warm-up"
        f" (warmup_steps={warmup_steps}), but the state has taken"
        f" {taken} steps, past it. Pass the number of steps taken so far"
        f" ({taken} here), counted from 0."
    )
  if not dense and taken < warmup_steps:
    # The state is behind the loop's count (steps skipped for non-finite
    # gradients, or a step counted from 1): its warm-up is not over yet.
    return state
  return switched


def _steps_taken(state: Any) -> int | None:
  """A state's ``count`` (the first device's when stacked), read from the
  device; None when abstract."""
  count = state.count
  if not isinstance(count, jax.Array):
    return None
  first = count.addressable_shards[0].data
  return int(np.asarray(jax.device_get(first)).ravel()[0])


def switch_to(compressing: Phase) -> Callable[[Any, bool], Any]:
  """``Compressor.at_step``'s switch of a state's marker into the dense
  phase, or out of it into ``compressing``."""

  def switch(state, dense):
    current = phase_of(state.phase)
    if dense and current is not Phase.DENSE:
      return state._replace(phase=marker_as(state.phase, Phase.DENSE))
    if not dense and current is Phase.DENSE:
      return state._replace(phase=marker_as(state.phase, compressing))
    return state

  return switch


def abstract_states(state: Any, phases: dict[str, Phase]) -> dict[str, Any]:
  """``Compressor.phases``: ``state`` with an abstract marker of each of
  ``phases``, by phase name, for lowering each phase's step."""
  abstract = jax.ShapeDtypeStruct(
      state.phase.shape,
      _DTYPE,
      sharding=getattr(state.phase, "sharding", None),
  )
  return {
      name: state._replace(phase=marker_as(abstract, phase))
      for name, phase in phases.items()
  }


def where(keep_new: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``keep_new``, else ``old``, leaf by leaf, for two states
  a step apart. A marker whose shape changed is ``new``'s: its shape cannot
  be selected at run time, so the phase advances with every step."""
  return jax.tree.map(
      lambda n, o: jnp.where(keep_new, n, o) if n.shape == o.shape else n,
      new,
      old,
  )
