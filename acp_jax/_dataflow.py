"""What a traced function's values depend on, read from its jaxpr (through
the public ``jax.extend.core`` types only)."""

from collections.abc import Sequence
import functools
from typing import Any

import jax
import jax.extend

_JAXPRS = (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)
# Equations that run their "jaxpr" parameter once on their operands.
_CALLS = frozenset(("jit", "shard_map", "closed_call", "remat"))
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

# Collectives that XLA lowers to an all-reduce of their operands.
_ALL_REDUCES = frozenset(("psum", "psum_invariant", "pmax", "pmin"))


def _collective_axes(params: dict) -> tuple | None:
  axes = params.get("axes", params.get("axis_name"))
  if axes is None:
    return None
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def flow(
    jaxpr: Any,
    flags: Sequence[bool],
    *,
    opaque: bool,
    reduced_over: tuple[str, ...] | None = None,
    mark: str | None = None,
) -> tuple[list[bool], list[bool]]:
  """Carries a flag per input of ``jaxpr`` to its outputs.

  An equation's results are flagged if an operand is, or if it is
  ``lax.axis_index``; a reducing collective over all of ``reduced_over``
  clears them. Literals and captured constants are not flagged. A plain
  call (a nested ``jit``, ``shard_map``) is followed inside; the results of
  another equation holding a jaxpr (``lax.cond``) are flagged ``opaque``.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr`` (``jax.make_jaxpr(f)(*args).jaxpr``).
    flags: one per input of ``jaxpr``, in the order of its flattened args.
    opaque: the flag of what cannot be seen through: the one that errs
      towards not raising (or towards counting).
    reduced_over: the axes whose reducing collectives clear flags, or None.
    mark: a function name: the flag of the operand of each ``jax.jit`` of
      that name is listed, in trace order.

  Returns:
    The flags of the outputs, and those of the marked calls' operands.
  """
  env = dict(zip(jaxpr.invars, flags))
  marked = []
  inner = functools.partial(
      flow, opaque=opaque, reduced_over=reduced_over, mark=mark
  )

  def read(v):
    return not isinstance(v, jax.extend.core.Literal) and env.get(v, False)

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if mark is not None and name == "jit" and eqn.params["name"] == mark:
      marked.append(ins[0])
    nested = _nested(eqn)
    if name == "axis_index":
      out = True
    elif _reduces_over(eqn, reduced_over):
      out = False
    elif name in _CALLS and len(nested) == 1:
      outs, inner_marked = inner(nested[0], ins)
      marked += inner_marked
      env.update(zip(eqn.outvars, outs))
      continue
    else:
      for j in nested:
        marked += inner(j, [opaque] * len(j.invars))[1]
      out = opaque if nested else any(ins)
    env.update((v, out) for v in eqn.outvars)
  return [read(v) for v in jaxpr.outvars], marked


def all_reduced_bytes(jaxpr: Any, axes: tuple[str, ...]) -> int:
  """The bytes of the operands of ``jaxpr``'s all-reduces (``psum``,
  ``pmax``, ``pmin``) over any of ``axes``, nested jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    over = _collective_axes(eqn.params) or ()
    if eqn.primitive.name in _ALL_REDUCES and set(over) & set(axes):
      total += sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
    total += sum(all_reduced_bytes(j, axes) for j in _nested(eqn))
  return total


def _nested(eqn: Any) -> list[Any]:
  """The jaxprs an equation holds (a call's, a conditional's branches)."""
  return [
      getattr(j, "jaxpr", j)
      for param in eqn.params.values()
      for j in (param if isinstance(param, tuple) else (param,))
      if isinstance(j, _JAXPRS)
  ]


def _reduces_over(eqn: Any, axes: tuple[str, ...] | None) -> bool:
  over = _collective_axes(eqn.params)
  return (
      axes is not None
      and over is not None
      and set(axes) <= set(over)
      and eqn.primitive.name in _REDUCING
  )
