"""What a transform that runs a compressor inside itself shares with the
others (``compressed_adam``, ``subspace_adam``): the compressor's residuals
lifted into one per-device field ``local``, its phases and warm-up passed
through, its arguments recorded, and the checks of its own."""

from typing import Any, Callable

from acp_jax import compressor as compressor_lib


# The properties of a wrapper's state (a NamedTuple whose field ``inner`` is
# the compressor's state) that the training loop and the phase read.
PHASE = property(
    lambda self: self.inner.phase,
    doc="The wrapped compressor's phase marker (see ``acp_jax.phase``).",
)
COUNT = property(
    lambda self: self.inner.count, doc="The wrapped compressor's step count."
)


class Local:
  """The split of a compressor's state into its per-device fields (its
  ``local_fields``, the residuals, which differ across devices), held in a
  wrapper's field ``local`` in that order, and the rest, None at those
  fields, held in ``inner`` and identical on every replica."""

  def __init__(self, compressor: compressor_lib.Compressor):
    self._fields = compressor.local_fields

  def split(self, inner: Any) -> tuple[tuple, Any]:
    """``(local, inner)``: the per-device fields, and the state with None
    at them."""
    local = tuple(getattr(inner, f) for f in self._fields)
    return local, inner._replace(**dict.fromkeys(self._fields))

  def join(self, state: Any) -> Any:
    """The compressor's whole state within a wrapper's ``state``."""
    return state.inner._replace(**dict(zip(self._fields, state.local)))


def around(
    compressor: compressor_lib.Compressor,
    init_fn: Callable[..., Any],
    update_fn: Callable[..., Any],
    name: str,
    args: dict[str, Any],
) -> compressor_lib.Compressor:
  """The ``Compressor`` whose state wraps ``compressor``'s in a field
  ``inner`` (its per-device fields in ``local``): it sends what
  ``compressor`` sends, in its phases, buckets and warm-up, and records
  ``(name, {"compressor": what made it, **args})``."""

  def phases(state):
    return {
        phase: state._replace(inner=inner)
        for phase, inner in compressor.phases(state.inner).items()
    }

  def to_phase(state, dense):
    switched = compressor.to_phase(state.inner, dense)
    return state if switched is state.inner else state._replace(inner=switched)

  inner_name, inner_args = compressor.made_by
  return compressor_lib.Compressor(
      init_fn,
      update_fn,
      compressor.volume,
      axis_name=compressor.axis_name,
      local_fields=("local",),
      phases=phases,
      bucket_bytes=compressor.bucket_bytes,
      leaf_order=compressor.leaf_order,
      packed_rounds=compressor.packed_rounds,
      cycle=compressor.cycle,
      warmup_steps=compressor.warmup_steps,
      to_phase=to_phase if compressor.warmup_steps else None,
      made_by=(
          name,
          {"compressor": {"name": inner_name, "args": inner_args}, **args},
      ),
  )


def check_args(
    name: str,
    compressor: Any,
    takes: tuple[str, ...],
    why: str,
    b1: float,
    b2: float,
    eps: float,
    **flags: Any,
) -> str:
  """Refuses a wrapper's arguments where they are not usable: a compressor
  not made by one of ``takes`` (``why`` says why those), moments' decays
  outside [0, 1), eps not positive, a flag not a bool. Returns the wrapped
  compressor's name."""
  made_by = getattr(compressor, "made_by", None)
  named = ", ".join(takes[:-1]) + (" or " if len(takes) > 1 else "") + takes[-1]
  if not isinstance(compressor, compressor_lib.Compressor) or not made_by:
    raise TypeError(
        f"{name} needs a compressor made by acp_jax.{named}, got"
        f" {type(compressor).__name__}"
    )
  if made_by[0] not in takes:
    raise ValueError(f"{name} takes {named}, got {made_by[0]}: {why}")
  for key, value in (("b1", b1), ("b2", b2)):
    if not 0 <= value < 1:
      raise ValueError(f"{name}: {key} must be in [0, 1), got {value!r}")
  if not eps > 0:
    raise ValueError(f"{name}: eps must be > 0, got {eps!r}")
  for key, value in flags.items():
    if not isinstance(value, bool):
      raise ValueError(f"{name}: {key} must be a bool, got {value!r}")
  return made_by[0]
