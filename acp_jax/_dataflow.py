"""What a traced function's values depend on, read from its jaxpr.

The trace-time checks and the accounting ask a step which of its values
come from which inputs: an aux value computed from this device's shard of
the batch, a gradient or a buffer computed from constants only (which XLA
folds away). They ask it of ``jax.make_jaxpr``'s jaxpr, through JAX's public
``jax.extend.core`` types, and of nothing else.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend

_JAXPRS = (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)
# Equations that run their "jaxpr" parameter once on their operands.
_CALLS = frozenset(("jit", "pjit", "shard_map", "closed_call", "remat"))
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

  An equation's results are flagged if one of its operands is, or if it is
  ``lax.axis_index``; a reducing collective over all of ``reduced_over``
  clears them (its result is the same on every device). Literals and
  captured constants are not flagged. A plain call (a nested ``jit``,
  ``shard_map``) is followed inside; the results of another equation that
  holds a jaxpr (``lax.cond``, ``lax.scan``) are flagged ``opaque``.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr`` (``jax.make_jaxpr(f)(*args).jaxpr``).
    flags: one per input of ``jaxpr``, in the order of its flattened args.
    opaque: the flag of what cannot be seen through, the one that errs
      towards not raising (or towards counting).
    reduced_over: the axes whose reducing collectives clear the flags, or
      None for no clearing.
    mark: a function name: the flag of the operand of each ``jax.jit`` of a
      function of that name is listed, in trace order.

  Returns:
    The flags of the outputs, and those of the marked calls' operands.
  """
  env = dict(zip(jaxpr.invars, flags))
  marked = []

  def read(v):
    return not isinstance(v, jax.extend.core.Literal) and env.get(v, False)

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    axes = _collective_axes(eqn.params)
    inner = eqn.params.get("jaxpr")
    if mark is not None and name in ("jit", "pjit"):
      if eqn.params.get("name") == mark:
        marked.append(ins[0])
    if name == "axis_index":
      outs = [True] * len(eqn.outvars)
    elif (
        reduced_over is not None
        and axes is not None
        and set(reduced_over) <= set(axes)
        and name in _REDUCING
    ):
      outs = [False] * len(eqn.outvars)
    elif name in _CALLS and isinstance(inner, _JAXPRS):
      outs, inner_marked = flow(
          getattr(inner, "jaxpr", inner),
          ins,
          opaque=opaque,
          reduced_over=reduced_over,
          mark=mark,
      )
      marked += inner_marked
    else:
      nested = [
          getattr(j, "jaxpr", j)
          for param in eqn.params.values()
          for j in (param if isinstance(param, tuple) else (param,))
          if isinstance(j, _JAXPRS)
      ]
      for j in nested:
        marked += flow(
            j,
            [opaque] * len(j.invars),
            opaque=opaque,
            reduced_over=reduced_over,
            mark=mark,
        )[1]
      outs = [opaque if nested else any(ins)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars], marked
