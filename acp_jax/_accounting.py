"""What ``DataParallel.comm_bytes`` counts: the collectives a step's trace
records, by mesh axis, and the traffic it cannot count."""

from typing import Any
import warnings

import jax

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
) -> dict[str, dict[str, compressor_lib.CommVolume]]:
  """``dp.comm_bytes(params)`` with a ``local_axis``: each phase's exchange
  traced on shapes, its collectives recorded by axis, plus on the local axis
  what the exchange does not trace: ``untraced``, by default the dense mean
  within the node."""
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  if untraced is None:
    untraced = compressor_lib.CommVolume(
        all_reduce=collectives.dense_nbytes(shapes)
    )
  grads = dp.abstract_local_grads(shapes)
  volumes = {dp.axis_name: {}, dp.local_axis: {}}
  for phase, comm in dp.phase_states(dp.abstract_comm(shapes)).items():
    with collectives.recording() as sent:
      jax.eval_shape(dp.compress, grads, comm)
    volumes[dp.axis_name][phase] = volume(sent, dp.axis_name)
    local = volume(sent, dp.local_axis)
    volumes[dp.local_axis][phase] = compressor_lib.CommVolume(
        all_reduce=local.all_reduce + untraced.all_reduce,
        all_gather=local.all_gather + untraced.all_gather,
    )
  return volumes


def warn_if_sharded_elsewhere(
    mesh: jax.sharding.Mesh, device_axes: tuple[str, ...], params: Any
) -> None:
  """Warns if a param is sharded over a mesh axis that is not a device
  axis: its all-gathers are traffic that ``comm_bytes`` does not count. The
  warning points at the caller of ``comm_bytes``, three frames up."""
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
