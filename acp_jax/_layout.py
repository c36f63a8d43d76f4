"""Where a ``DataParallel``'s arrays live on its mesh: the batch and local
gradients one slice per device, the compressor's per-device fields (the
residuals) one per node, everything else replicated."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from acp_jax import _accounting
from acp_jax import _specs
from acp_jax import compressor as compressor_lib


class Layout:
  """The axes of ``mesh`` a compressor's data parallelism runs over, and
  where each array of its step lives (``DataParallel`` has the arguments)."""

  def __init__(
      self,
      compressor: compressor_lib.Compressor,
      mesh: jax.sharding.Mesh,
      local_axis: str | None = None,
  ):
    if not isinstance(compressor, compressor_lib.Compressor):
      raise TypeError(
          "DataParallel needs a compressor made by an acp_jax factory (e.g."
          f" acp_jax.acp_sgd(4)), got {type(compressor).__name__}"
      )
    if compressor.axis_name not in mesh.axis_names:
      raise ValueError(
          f"the compressor's axis_name={compressor.axis_name!r} is not an"
          f" axis of the mesh, whose axes are {mesh.axis_names}"
      )
    if local_axis is not None and local_axis not in mesh.axis_names:
      raise ValueError(
          f"local_axis={local_axis!r} is not an axis of the mesh, whose axes"
          f" are {mesh.axis_names}"
      )
    if local_axis == compressor.axis_name:
      raise ValueError(
          f"local_axis={local_axis!r} is the compressor's own axis: the"
          " dense mean runs within a node and the compressor across nodes,"
          " over two different axes of the mesh"
      )
    self.compressor = compressor
    self.mesh = mesh
    self.axis_name = compressor.axis_name
    self.local_axis = local_axis
    # The axes a batch is split over, the compressor's (slow) one first.
    self.device_axes = (self.axis_name,) + (
        () if local_axis is None else (local_axis,)
    )
    # Compressed exchange participants: one per node when hierarchical.
    self.num_nodes = mesh.shape[self.axis_name]
    self.num_devices = self.num_nodes * (
        1 if local_axis is None else mesh.shape[local_axis]
    )

  @property
  def device_spec(self) -> P:
    """The spec of arrays stacked one slice per device: the layout of the
    local gradients, of split batches, and of per-device ``aux``."""
    if self.local_axis is None:
      return P(self.axis_name)
    return P(self.device_axes)

  def comm_specs(self, comm_state: Any) -> Any:
    """A ``PartitionSpec`` prefix tree of the compressor's state: its
    per-device fields sharded over the compressor's axis (replicated over
    ``local_axis``, where the residuals of a node's devices agree)."""
    local = self.compressor.local_fields
    return type(comm_state)(
        *(P(self.axis_name) if f in local else P() for f in comm_state._fields)
    )

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def _map_local(self, f: Callable, comm_state: Any) -> Any:
    """``f`` on every array of the state's per-device fields."""
    local = self.compressor.local_fields
    return type(comm_state)(
        *(
            jax.tree.map(f, value) if name in local else value
            for name, value in zip(comm_state._fields, comm_state)
        )
    )

  def init_comm(self, params: Any) -> Any:
    """The compressor's state for ``params`` (or their shapes), made on the
    devices directly, in its layout: it depends on the shapes only."""
    return self._comm_init(params)()

  def _comm_init(self, params: Any) -> Callable[[], Any]:
    """``init_comm(params)``'s program, jitted with its out shardings."""
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    specs = self.comm_specs(jax.eval_shape(self.compressor.init, shapes))
    n = self.num_nodes

    def make():
      return self._map_local(
          lambda x: jnp.broadcast_to(x, (n,) + x.shape),
          self.compressor.init(shapes),
      )

    shardings = jax.tree.map(self._sharding, specs, is_leaf=_specs.is_spec)
    return jax.jit(make, out_shardings=shardings)

  def param_shardings(self, params: Any) -> Any:
    """Where the params live: replicated, a ``NamedSharding`` per leaf."""
    return jax.tree.map(lambda _: self._sharding(P()), params)

  def _inner_init(
      self, tx: optax.GradientTransformation, params: Any
  ) -> Callable[[Any], Any]:
    del params
    return jax.jit(tx.init, out_shardings=self._sharding(P()))

  def abstract_comm(self, params: Any) -> Any:
    """Shapes and shardings of ``init_comm(params)``, allocating nothing."""
    return jax.eval_shape(self._comm_init(params))

  def compress_shardings(self, params: Any) -> tuple[Any, Any]:
    """The shardings of ``compress``'s results for ``params``: the mean's,
    replicated, and the state's; for ``jax.jit(dp.compress,
    donate_argnums=(1,), out_shardings=dp.compress_shardings(params))``."""
    comm = self.abstract_comm(params)
    return self._sharding(P()), jax.tree.map(lambda x: x.sharding, comm)

  def abstract_local_grads(self, params: Any) -> Any:
    """Shapes and shardings of the stacked local gradients of ``params``."""
    sharding = self._sharding(self.device_spec)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (self.num_devices,) + tuple(x.shape), x.dtype, sharding=sharding
        ),
        params,
    )

  def phase_states(self, comm_state: Any) -> dict[str, Any]:
    """The compressor's state before each phase's step (abstract where the
    phase is recorded), by the phase names of ``acp_jax.comm_bytes``."""
    return self.compressor.phases(comm_state)

  def _warn_if_sharded_elsewhere(self, params: Any) -> None:
    _accounting.warn_if_sharded_elsewhere(self.mesh, self.device_axes, params)
