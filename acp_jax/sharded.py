"""Sharded data parallelism: ZeRO-3 within a node, compression across nodes.

``ShardedDataParallel`` is hierarchical ``DataParallel`` (nodes x devices
per node, the compressor over the node axis) whose devices hold only their
share of the model: within a node, as in FSDP or ZeRO-3, every device keeps
about 1/L of each param, of the optimizer's state and of the compressor's
residuals (L the devices per node); across nodes, any compressor sends what
it would send in the hierarchical mode.

Layouts. A param lives sharded over the local axis on its first axis that L
divides (``param_shardings``; replicated if none does), and so does every
array of the optimizer's state of its shape. The compressor works on blocks
of rows: each leaf is zero-padded along its leading axis to a multiple of L,
and device i holds block i of rows of its residual (and of ACP-SGD's P
factor); the m x r factors are replicated. Where L divides the leading axis
both layouts agree; otherwise the step moves the mean between them
(collectives that ``comm_bytes`` does not count).

A step. ``value_and_grad`` is the hierarchical mode's (XLA gathers the
sharded params whole over the local axis, counted as all-gathers there).
The exchange then (``compress``):

1. sums each gradient densely over the node's devices and keeps its own
   block of rows;
2. runs the compressor across nodes on the blocks, within
   ``collectives.row_shards``: a block of rows of M is all a device needs
   for its rows of P = M Q and of the residual; the sums over rows
   (Q = M^T P, the Gram matrices of ``orthogonalize.orthogonalize_rows``)
   are all-reduced over the local axis. Up to rounding and the signs of
   its columns, which no update depends on, the result is one device's on
   the whole matrix. Sign-SGD's scale is ``collectives.leaf_mean``'s;
   Top-k's selection is the node's (``collectives.row_gather``);
3. sends across nodes each device's blocks whole, and the sums and Top-k's
   selection, identical within the node, in L chunks: each device sends
   about 1/L of the node's compressed bytes, ACP-SGD still in one round;
4. returns each device's block of the mean, so that the optimizer's update
   runs on the shards.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from acp_jax import _accounting
from acp_jax import _specs
from acp_jax import collectives
from acp_jax import compressor as compressor_lib
from acp_jax import data_parallel
from acp_jax import phase as phase_lib
from acp_jax import registry


class ShardedDataParallel(data_parallel.DataParallel):
  """``DataParallel`` with params, optimizer state and residuals sharded
  within each node.

  Args:
    compressor: made by a registered factory that is ``row_sharded``
      (``acp_jax.registry``; the library's five); its ``axis_name`` is the
      node axis of ``mesh``.
    mesh: nodes x devices per node.
    local_axis: the axis of a node's devices, over which the model is
      sharded and gradients are summed densely.
    nonfinite: as for ``DataParallel``; the node agrees on the verdict by a
      4-byte all-reduce over ``local_axis``.

  Example (2 hosts of 4 devices; the loop is ``DataParallel``'s, with the
  params placed by ``param_shardings``)::

    mesh = jax.make_mesh((2, 4), ("data", "local"))
    dp = acp_jax.ShardedDataParallel(acp_jax.acp_sgd(4), mesh,
                                     local_axis="local")
    params = jax.device_put(params, dp.param_shardings(params))
    tx = dp.chain(optax.adamw(1e-3))
    opt_state = tx.init(params)
  """

  def __init__(
      self,
      compressor: compressor_lib.Compressor,
      mesh: jax.sharding.Mesh,
      *,
      local_axis: str,
      nonfinite: str = "keep",
  ):
    if local_axis is None:
      raise ValueError(
          "ShardedDataParallel needs local_axis, the mesh axis of a node's"
          " devices over which the model is sharded; for a model replicated"
          " on every device use DataParallel"
      )
    super().__init__(
        compressor, mesh, local_axis=local_axis, nonfinite=nonfinite
    )
    made_by = (compressor.made_by or ("a custom compressor",))[0]
    row_sharded = [n for n in registry.names() if registry.get(n).row_sharded]
    if made_by not in row_sharded:
      raise ValueError(
          f"ShardedDataParallel runs {', '.join(row_sharded)} on blocks of"
          f" rows, not {made_by}, whose sums over a leaf it cannot know; use"
          " DataParallel(compressor, mesh, local_axis=...) for it"
      )
    self.local_size = mesh.shape[local_axis]

  # -- layout -----------------------------------------------------------------

  def param_spec(self, shape: tuple[int, ...]) -> P:
    """Sharded over ``local_axis`` on the first axis it divides, else
    replicated: the layout of a param, and of optimizer state like it."""
    for d, size in enumerate(shape):
      if size % self.local_size == 0:
        return P(*(None,) * d, self.local_axis)
    return P()

  def param_shardings(self, params: Any) -> Any:
    """A ``NamedSharding`` per leaf of ``params`` (or of their shapes): put
    them there with ``jax.device_put(params, dp.param_shardings(params))``."""
    return jax.tree.map(
        lambda x: self._sharding(self.param_spec(tuple(x.shape))), params
    )

  def _inner_init(self, tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init``, jitted to lay out each array of its state as a param of
    its shape."""
    shardings = self.param_shardings(jax.eval_shape(tx.init, params))
    return jax.jit(tx.init, out_shardings=shardings)

  def _rows(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The compressor's view of a leaf: its leading axis zero-padded to a
    multiple of L (a scalar as a vector of L)."""
    shape = tuple(shape) or (1,)
    rows = -(-shape[0] // self.local_size) * self.local_size
    return (rows,) + shape[1:]

  def _row_shapes(self, params: Any) -> tuple[Any, Any]:
    """The compressor's whole leaves, and one device's blocks of rows."""
    whole = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(self._rows(x.shape), x.dtype), params
    )
    block = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] // self.local_size,) + x.shape[1:], x.dtype
        ),
        whole,
    )
    return whole, block

  def _comm_specs(self, params: Any) -> Any:
    """The compressor's state's spec per array: rows sharded over the local
    axis where a device's block differs from the whole (its residual, a P
    factor), else replicated; its ``local_fields`` also stacked over the
    node axis."""
    whole, block = self._row_shapes(params)
    init = self.compressor.init
    whole_state = jax.eval_shape(init, whole)
    with collectives.row_shards(self.local_axis, self.local_size):
      block_state = jax.eval_shape(init, block)
    per_node = self.compressor.local_fields
    fields = []
    for name, w, b in zip(whole_state._fields, whole_state, block_state):
      spec = lambda w, b: P(
          *(self.axis_name,) * (name in per_node),
          *(self.local_axis,) * (w.shape != b.shape),
      )
      fields.append(jax.tree.map(spec, w, b))
    return type(whole_state)(*fields)

  def _comm_init(self, params: Any) -> Any:
    """``init_comm(params)``'s program: the compressor's state for the
    padded leaves, sharded."""
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    whole, _ = self._row_shapes(shapes)
    n = self.num_nodes

    def make():
      return self._map_local(
          lambda x: jnp.broadcast_to(x, (n,) + x.shape),
          self.compressor.init(whole),
      )

    shardings = jax.tree.map(
        self._sharding,
        self._comm_specs(shapes),
        is_leaf=_specs.is_spec,
    )
    return jax.jit(make, out_shardings=shardings)

  # -- the exchange ------------------------------------------------------------

  def _compress(
      self, local_grads: Any, comm_state: Any
  ) -> tuple[Any, Any, Any]:
    """``compress``: each device's block of rows of the mean, placed as the
    params; and whether the mean is finite."""
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), local_grads
    )
    specs = self._comm_specs(params)
    whole, _ = self._row_shapes(params)
    local, parts = self.local_axis, self.local_size
    real_rows = [x.shape[0] if x.shape else 1 for x in jax.tree.leaves(params)]

    def block_of_sum(g, rows):
      g = collectives.all_reduce(g, local) / parts
      g = g.reshape((-1,) + g.shape[1:])  # a scalar as a vector
      g = jnp.pad(
          g, [(0, rows.shape[0] - g.shape[0])] + [(0, 0)] * (g.ndim - 1)
      )
      size = rows.shape[0] // parts
      return lax.dynamic_slice_in_dim(g, lax.axis_index(local) * size, size)

    def body(grads, old):
      grads = jax.tree.map(lambda x: x[0], grads)
      blocks = jax.tree.map(block_of_sum, grads, whole)
      mean, state, old, finite = self._device_update(
          blocks, old, collectives.row_shards(local, parts, rows=real_rows)
      )
      # A device's blocks reach only its peers of the same index on the
      # other nodes: the node's devices agree on the verdict, where it is
      # used (a stateless compressor's is, only to skip the step).
      used = jax.tree.leaves(state) or self.nonfinite == "skip"
      if self.nonfinite != "propagate" and used:
        bad = collectives.all_reduce((~finite).astype(jnp.float32), local)
        finite = bad == 0
        state = phase_lib.where(finite, state, old)
      return mean, self._map_local(lambda x: x[None], state), finite

    rows = jax.tree.map(lambda _: P(local), params)
    mean, state, finite = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(self.device_spec, specs),
        out_specs=(rows, specs, P()),
        check_vma=False,
    )(local_grads, comm_state)
    mean = jax.tree.map(self._as_param, mean, params)
    return mean, state, finite

  def _as_param(self, rows: jax.Array, param: Any) -> jax.Array:
    """A leaf from the compressor's padded rows, placed as the param."""
    x = rows[: param.shape[0] if param.shape else 1].reshape(param.shape)
    return lax.with_sharding_constraint(
        x, self._sharding(self.param_spec(tuple(param.shape)))
    )

  def comm_bytes(
      self, params: Any
  ) -> dict[str, dict[str, compressor_lib.CommVolume]]:
    """Bytes one step sends per device on each mesh axis, by phase.

    Args:
      params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` like them.

    Returns:
      ``{axis name: {phase: CommVolume}}``: on the compressor's axis what a
      device sends of its blocks across nodes; on ``local_axis``, the dense
      sum of every gradient, the sums over rows and the chunks gathered
      back (``collectives.recording``), plus the all-gather of the sharded
      params. As for ``DataParallel.comm_bytes``, the loss's mean and other
      axes' collectives are not counted.
    """
    self._warn_if_sharded_elsewhere(params)
    gathered = sum(
        collectives.nbytes(x.shape, x.dtype)
        for x in jax.tree.leaves(params)
        if self.param_spec(tuple(x.shape)) != P()
    )
    # The gradient's dense sum is traced; the params' all-gather is not.
    return _accounting.hierarchical(
        self, params, compressor_lib.CommVolume(all_gather=gathered)
    )


class MemoryPerDevice(NamedTuple):
  """Bytes that one device holds, from the arrays' shardings.

  Attributes:
    params: of the params.
    opt_state: of the optimizer's state.
    compressor: of the compressor's state (residuals, factors).
  """

  params: int
  opt_state: int
  compressor: int

  @property
  def total(self) -> int:
    return self.params + self.opt_state + self.compressor


def memory_per_device(
    dp: data_parallel.DataParallel,
    params: Any,
    tx: optax.GradientTransformation,
) -> MemoryPerDevice:
  """What the most loaded device holds for ``dp.chain(tx)``, allocating
  nothing.

  Args:
    dp: a ``DataParallel`` or ``ShardedDataParallel``.
    params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` like them;
      placed by ``dp.param_shardings``.
    tx: the optimizer that ``dp.chain`` wraps.

  Returns:
    The bytes of each array's largest shard, summed by kind; activations
    and gradients, which live during a step only, are not counted.
  """
  placed = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      params,
      dp.param_shardings(params),
  )
  return MemoryPerDevice(
      params=_shard_bytes(placed),
      opt_state=_shard_bytes(
          jax.eval_shape(dp._inner_init(tx, placed), placed)
      ),
      compressor=_shard_bytes(dp.abstract_comm(placed)),
  )


def _shard_bytes(tree: Any) -> int:
  """Bytes of one shard of every array of ``tree`` (the whole array where
  it has no sharding)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += collectives.nbytes(shape, x.dtype)
  return total
