"""What ``DataParallel.comm_bytes`` counts: the collectives a step's trace
records, by mesh axis, and the traffic it cannot count."""

from typing import Any, Callable
import warnings

import jax

from acp_jax import _dataflow
from acp_jax import _local_grads
from acp_jax import collectives
from acp_jax import compressor as compressor_lib


def volume(
    sent: list[collectives.Sent], axis_name: str
) -> compressor_lib.CommVolume:
  """The bytes of the recorded collectives over ``axis_name``."""
  by_kind = {"all_reduce": 0, "all_gather": 0}
  for s in sent:
    if s.axis_name == axis_name:
      by_kind[s.kind] += s.nbytes
  return compressor_lib.CommVolume(**by_kind)


def hierarchical(
    dp: Any,
    params: Any,
    untraced: compressor_lib.CommVolume | None = None,
    unused: list[bool] | None = None,
) -> dict[str, dict[str, compressor_lib.CommVolume]]:
  """``dp.comm_bytes(params)`` from the exchange traced on shapes: each
  phase's collectives by axis, plus on ``local_axis`` what is not traced:
  ``untraced``, by default the dense mean within the node. ``unused`` (a
  flag per leaf): leaves whose gradient is zero whatever the batch, given
  as zeros so that the collectives XLA folds away are not counted."""
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  if untraced is None:
    untraced = compressor_lib.CommVolume(
        all_reduce=collectives.dense_nbytes(
            [
                x
                for i, x in enumerate(jax.tree.leaves(shapes))
                if unused is None or not unused[i]
            ]
        )
    )
  grads = dp.abstract_local_grads(shapes)
  axes = [a for a in (dp.axis_name, dp.local_axis) if a is not None]
  volumes = {axis: {} for axis in axes}
  for phase, comm in dp.phase_states(dp.abstract_comm(shapes)).items():
    if unused is None:
      with collectives.recording() as sent:
        jax.eval_shape(dp.compress, grads, comm)
    else:
      sent = collectives.recorded_unless_folded(
          # pylint: disable-next=protected-access
          lambda g, c: dp._compress(g, c, unused)[:2], grads, comm
      )
    for axis in axes:
      volumes[axis][phase] = volume(sent, axis)
  if dp.local_axis is not None:
    volumes[dp.local_axis] = {
        phase: compressor_lib.CommVolume(
            all_reduce=v.all_reduce + untraced.all_reduce,
            all_gather=v.all_gather + untraced.all_gather,
        )
        for phase, v in volumes[dp.local_axis].items()
    }
  return volumes


def unused_leaves(
    fun: Callable[..., Any], params: Any, batch: tuple, has_aux: bool
) -> list[bool]:
  """For each leaf of ``params`` (a pytree, or an NNX module's ``nnx.Param``
  state), whether ``fun``'s gradient is zero whatever the batch: a param the
  loss never reads, whose gradient ``jax.grad`` makes from constants only."""
  nnx = _local_grads.flax_nnx()
  if nnx is not None and isinstance(params, nnx.Module):
    graphdef, state, rest = nnx.split(params, nnx.Param, ...)
    # The rest (BatchNorm statistics, Rngs counts) goes in as an argument:
    # merged inside the trace, the module's copy may update it there.
    loss = lambda p, r, *b: fun(nnx.merge(graphdef, p, r), *b)
    batch = (nnx.as_pure(rest), *batch)
    params = nnx.as_pure(state)
  else:
    loss = fun
  grad = jax.grad(lambda p, *b: loss(p, *b)[0] if has_aux else loss(p, *b))
  jaxpr = jax.make_jaxpr(grad)(params, *batch).jaxpr
  from_inputs = _dataflow.flow(
      jaxpr, [True] * len(jaxpr.invars), opaque=True
  )[0]
  return [not f for f in from_inputs]


def loss_step_bytes(
    dp: Any,
    fun: Callable[..., Any],
    params: Any,
    batch: tuple,
    has_aux: bool,
    batch_norm: str,
) -> int:
  """Bytes all-reduced over the device axes by ``dp.value_and_grad(fun)``
  besides the loss's mean: BatchNorm's statistics (and, under
  ``batch_norm="global"``, their gradient's), state averaged after the step,
  and ``fun``'s own collectives. An NNX module is left as it is."""
  value_and_grad = dp.value_and_grad(
      fun, has_aux=has_aux, batch_norm=batch_norm
  )
  nnx = _local_grads.flax_nnx()
  if nnx is not None and isinstance(params, nnx.Module):
    graphdef, state = nnx.split(params)
    step = lambda s, *b: value_and_grad(nnx.merge(graphdef, s), *b)
    params = nnx.as_pure(state)
  else:
    step = value_and_grad
  closed = jax.make_jaxpr(step)(params, *batch)
  loss = closed.out_avals[0]
  return _dataflow.all_reduced_bytes(closed.jaxpr, dp.device_axes) - (
      loss.size * loss.dtype.itemsize
  )


def warn_if_sharded_elsewhere(
    mesh: jax.sharding.Mesh, device_axes: tuple[str, ...], params: Any
) -> None:
  """Warns, at the caller of ``comm_bytes`` three frames up, if a param is
  sharded over a non-device mesh axis: its all-gathers go uncounted."""
  others = set(mesh.axis_names) - set(device_axes)
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    spec = getattr(getattr(x, "sharding", None), "spec", None) or ()
    axes = {
        a
        for entry in spec
        if entry is not None
        for a in (entry if isinstance(entry, tuple) else (entry,))
    }
    if axes & others:
      warnings.warn(
          f"DataParallel.comm_bytes: param {jax.tree_util.keystr(path)} is"
          f" sharded over mesh axis {sorted(axes & others)[0]!r}, which is"
          " not a data axis. The step takes every param whole on each"
          " device, so XLA adds collectives over that axis (all-gathers of"
          " such params) that these bytes do not count. Replicate the"
          " params, NamedSharding(mesh, P()), for them to count all.",
          stacklevel=4,
      )
      return


def step_volumes(
    dp: Any,
    params: Any,
    fun: Callable[..., Any] | None,
    batch: tuple,
    *,
    has_aux: bool,
    batch_norm: str,
) -> dict[str, dict[str, compressor_lib.CommVolume]]:
  """``dp.comm_bytes(params, fun, *batch)``: bytes by axis and phase, less
  the collectives of params ``fun`` never reads, plus those of
  ``value_and_grad(fun)`` but the loss's mean."""
  if fun is None:
    unused, extra = None, 0
  else:
    unused = unused_leaves(fun, params, batch, has_aux)
    extra = loss_step_bytes(dp, fun, params, batch, has_aux, batch_norm)
  nnx = _local_grads.flax_nnx()
  if nnx is not None and isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  warn_if_sharded_elsewhere(dp.mesh, dp.device_axes, params)
  if dp.local_axis is None and unused is None:
    volumes = {
        dp.axis_name: compressor_lib.comm_bytes(
            dp.compressor, params, num_devices=dp.num_nodes
        )
    }
  else:
    volumes = hierarchical(dp, params, unused=unused)
  volumes[dp.axis_name] = {
      phase: v._replace(all_reduce=v.all_reduce + extra)
      for phase, v in volumes[dp.axis_name].items()
  }
  return volumes
