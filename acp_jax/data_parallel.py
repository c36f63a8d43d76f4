"""Compressed data parallelism over a device mesh, beside the user's optimizer.

The JAX counterpart of PyTorch DDP with a communication hook: the compressor
and its state live beside the user's optimizer, not inside it.
``DataParallel`` owns what a plain ``jit`` + ``NamedSharding`` loop lacks:
each device's own gradient (``value_and_grad``, under ``jax.shard_map`` with
``check_vma=False`` so that ``jax.grad`` inserts no dense all-reduce,
returned stacked on a leading device axis as a ``LocalGrads`` that only
``chain(tx)`` accepts); the state layout (the residuals stacked on that
axis, everything else replicated); and the one compressed exchange
(``chain(tx)``). It works on any mesh that has the compressor's axis, across
processes too, for pytrees of params and for Flax NNX modules.

Hierarchical (``local_axis``, nodes x devices per node): the gradients are
first averaged densely within each node, then compressed across nodes. The
residuals, then identical within a node, are stored once per node; so is
every buffer sent, so each device sends its own chunk of it across nodes
(``collectives.split_over``): a node's link carries the compressed bytes
once, not once per device.

The pieces live apart: ``_layout``, ``_local_grads``, ``_specs`` (how the
batch arguments split) and ``_accounting`` (``comm_bytes``).
"""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from acp_jax import _accounting
from acp_jax import _layout
from acp_jax import _loss
from acp_jax import _checks
from acp_jax import _local_grads
from acp_jax import _specs
from acp_jax import collectives
from acp_jax import compressor as compressor_lib
from acp_jax import overlap as overlap_lib
from acp_jax import phase as phase_lib
from acp_jax._local_grads import LocalGrads


class DataParallelState(NamedTuple):
  """State of ``DataParallel.chain(tx)``.

  Attributes:
    comm: the compressor's state; its ``local_fields`` (the residuals) carry
      a leading axis of one slice per device (per node, when hierarchical),
      sharded; its other fields are replicated.
    inner: the state of the optimizer ``tx`` it feeds, replicated.
  """

  comm: Any
  inner: Any


# DataParallel's choices for a step whose mean gradient is not finite.
NONFINITE_POLICIES = ("keep", "skip", "propagate")
# How value_and_grad's loss is averaged: per device, or over the global count.
NORMALIZATIONS = ("device", "global")
# Over which batch value_and_grad's NNX BatchNorm layers normalise.
BATCH_NORMS = ("global", "local")


def _values(tree: Any) -> Any:
  """``tree`` with any NNX ``Variable`` replaced by its value: the state
  made from it carries no param's metadata (e.g. a sharding annotation,
  which flax's eager sharding would apply to residuals stacked per node)."""
  nnx = _local_grads.flax_nnx()
  return tree if nnx is None else nnx.as_pure(tree)


class DataParallel(_layout.Layout):
  """A compressor applied across the data axis of a mesh.

  Args:
    compressor: made by an ``acp_jax`` factory; its ``axis_name`` must be an
      axis of ``mesh``.
    mesh: the device mesh; batches are split along ``compressor.axis_name``
      (and ``local_axis``). Params sharded over other axes (model
      parallelism) are gathered whole for each step, by collectives that
      ``comm_bytes`` does not count (it warns).
    local_axis: None, or an axis of ``mesh`` over which gradients are first
      averaged densely: dense within a host, compressed across hosts.
    nonfinite: what a step does whose mean gradient is not finite.
      ``"keep"``: the compressor's state stays as it was (ACP-SGD's phase,
      a shape, still advances) and the mean goes on to ``tx``:
      ``dp.chain(optax.apply_if_finite(tx, n))`` then skips it. ``"skip"``:
      the whole step is skipped, ``tx``'s state kept and the updates zero.
      ``"propagate"``: no check; the residuals take the non-finite values.
      Each is a select, no conditional, no byte sent; on XLA:CPU keeping a
      low-rank residual costs a copy of it per step
      (``tests/test_lowrank_arithmetic.py``).

  Example (pure params; ``loss_fn(params, batch)`` returns a scalar)::

    dp = acp_jax.DataParallel(acp_jax.acp_sgd(rank=4), mesh)
    tx = dp.chain(optax.adam(1e-3))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
      loss, grads = dp.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  With Flax NNX, ``nnx.Optimizer(model, dp.chain(tx), wrt=nnx.Param)`` and
  ``dp.value_and_grad(loss_fn)(model, batch)`` inside ``nnx.jit``.

  Hierarchical, 2 hosts of 4 devices::

    mesh = jax.make_mesh((2, 4), ("data", "local"))
    dp = acp_jax.DataParallel(acp_jax.acp_sgd(rank=4), mesh, local_axis="local")
  """

  def __init__(
      self,
      compressor: compressor_lib.Compressor,
      mesh: jax.sharding.Mesh,
      *,
      local_axis: str | None = None,
      nonfinite: str = "keep",
  ):
    super().__init__(compressor, mesh, local_axis)
    _checks.choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    self.nonfinite = nonfinite

  def comm_bytes(
      self,
      params: Any,
      fun: Callable[..., Any] | None = None,
      *batch: Any,
      has_aux: bool = False,
      batch_norm: str = "global",
  ) -> dict[str, dict[str, compressor_lib.CommVolume]]:
    """Bytes one step sends per device on each mesh axis, by phase.

    Args:
      params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` like
        them, or a Flax NNX module (its ``nnx.Param`` variables).
      fun: None, or the loss as given to ``value_and_grad``; with ``batch``
        (arrays or their shapes) it tells which params the loss never reads,
        whose zero gradient's collectives XLA folds away (factors computed
        from a residual still count), and adds the step's other all-reduces
        on the compressor's axis (BatchNorm's statistics, a module's state,
        ``fun``'s own collectives), but not the loss's mean.
      *batch: the arguments after the params of ``fun``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      batch_norm: as given to ``value_and_grad``; ``"global"`` sends the
        statistics of each ``nnx.BatchNorm``.

    Returns:
      ``{axis name: {phase: CommVolume}}``, phases named as by
      ``acp_jax.comm_bytes``, traced on shapes only. With ``local_axis``,
      the compressor's axis carries each device's chunks of the compressed
      buffers, and ``local_axis`` the dense all-reduce of every gradient and
      the all-gathers of the chunks. Neither the loss's mean nor collectives
      over the mesh's other axes count (params sharded over one warn here).
    """
    _checks.choice("batch_norm", batch_norm, BATCH_NORMS)
    return _accounting.step_volumes(
        self, params, fun, batch, has_aux=has_aux, batch_norm=batch_norm
    )

  def at_step(self, opt_state: Any, step: int) -> Any:
    """``opt_state`` set to run step ``step`` (counted from 0): for a
    compressor with a dense warm-up, call it before every step (see
    ``Compressor.at_step``); otherwise it is the identity.

    Args:
      opt_state: the state of ``chain(tx)`` (a ``DataParallelState``), or an
        ``nnx.Optimizer`` built on ``chain(tx)``, which is updated in place.
      step: the number of steps taken so far.

    Returns:
      The state to pass to that step (the ``nnx.Optimizer`` itself).
    """
    nnx = _local_grads.flax_nnx()
    if nnx is not None and isinstance(opt_state, nnx.Optimizer):
      variables = opt_state.opt_state.comm
      is_variable = lambda x: isinstance(x, nnx.Variable)
      values = jax.tree.map(
          lambda v: v.get_value(), variables, is_leaf=is_variable
      )

      def put(variable, value):
        if value is not variable.get_value():
          variable.set_value(value)

      jax.tree.map(
          put,
          variables,
          self.compressor.at_step(values, step),
          is_leaf=is_variable,
      )
      return opt_state
    if not isinstance(opt_state, DataParallelState):
      raise TypeError(
          "at_step takes the state of DataParallel.chain(tx) or an"
          f" nnx.Optimizer built on it, got {type(opt_state).__name__}"
      )
    return opt_state._replace(
        comm=self.compressor.at_step(opt_state.comm, step)
    )

  # -- the exchange -----------------------------------------------------------

  def compress(self, local_grads: Any, comm_state: Any) -> tuple[Any, Any]:
    """The compressed mean of the devices' gradients, and the new state.

    Jitted with ``comm_state`` donated, give ``jit`` the results' shardings
    (``out_shardings=compress_shardings(params)``): without them XLA pairs
    the donated residuals with the first outputs of their size, the mean's,
    and copies them first.

    Args:
      local_grads: each device's gradient, stacked on a leading axis sharded
        over the device axes (``value_and_grad``'s ``LocalGrads.stacked``).
      comm_state: the compressor's state, from ``init_comm``.

    Returns:
      ``(mean, comm_state)``: the (approximate) mean gradient, replicated,
      and the compressor's next state (unchanged but for ACP-SGD's phase
      where the mean is not finite, unless ``nonfinite="propagate"``).
    """
    mean, comm_state, _ = self._compress(local_grads, comm_state)
    return mean, comm_state

  def _compress(
      self, local_grads: Any, comm_state: Any, unused: Any = None
  ) -> tuple[Any, Any, Any]:
    """``compress``, and whether the mean is finite (a replicated bool).
    ``unused``: None, or a flag per leaf whose gradient is taken as a
    constant zero, as XLA sees a param the loss never reads."""
    specs = self.comm_specs(comm_state)

    def body(grads, blocks):
      # Each device sees [1, ...] blocks of the stacked arrays.
      grads = jax.tree.map(lambda x: x[0], grads)
      if unused is not None:
        leaves, treedef = jax.tree.flatten(grads)
        grads = treedef.unflatten(
            [jnp.zeros_like(g) if u else g for g, u in zip(leaves, unused)]
        )
      if self.local_axis is not None:
        # Then the node's residuals stay identical: one copy per node.
        grads = lax.pmean(grads, self.local_axis)
      mean, state, _, finite = self._device_update(
          grads, blocks, collectives.split_over(self.local_axis)
      )
      state = self._map_local(lambda x: x[None], state)
      if self.nonfinite != "propagate":
        # Selected against the donated blocks themselves, in their shape,
        # the select fuses into the pass that writes E' in place. Against
        # E reshaped to the matrix, XLA:CPU writes E' to a temporary and
        # copies it back on a one-device mesh (BERT-Base: a 418 MB
        # temporary, ACP-SGD's update 681 ms against 546).
        state = phase_lib.where(finite, state, blocks)
      return mean, state, finite

    return jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(self.device_spec, specs),
        out_specs=(P(), specs, P()),
        check_vma=False,
    )(local_grads, comm_state)

  def _device_update(
      self, grads: Any, blocks: Any, split: Any
  ) -> tuple[Any, Any, Any, jax.Array]:
    """The compressor's update on one device, its collectives split as
    ``split`` says: the mean, the new and old (unstacked) states, and
    whether every float received is finite, which a non-finite gradient on
    any device spoils on every replica alike, with no byte more sent."""
    old = self._map_local(lambda x: x[0], blocks)
    with split, collectives.receiving() as received, _checks.placed():
      mean, state = self.compressor.update(grads, old)
    floats = [x for x in received if jnp.issubdtype(x.dtype, jnp.inexact)]
    return mean, state, old, _all_finite(floats)

  def chain(
      self, tx: optax.GradientTransformation
  ) -> optax.GradientTransformation:
    """``tx`` fed with the compressed mean of the devices' gradients.

    ``update`` takes the ``LocalGrads`` of ``value_and_grad``; the state is
    a ``DataParallelState``. Other transforms (clipping, weight decay) go in
    ``tx`` and see the compressed mean. Refused: a ``tx`` whose update of a
    gradient of ones is not finite or climbs it (here, or by ``init`` where
    the probe needs the params), and by ``init`` one that holds
    ``optax.MultiSteps`` (the exchange would send at every micro-step: add
    micro-batches' local gradients with ``+`` instead).
    """

    where = "DataParallel.chain(tx)"
    probed = _checks.check_descends(tx, None, where)

    def init_fn(params):
      if not probed:
        _checks.check_descends(tx, params, where)
      inner = self._inner_init(tx, params)(params)
      _checks.check_optimizer_after(inner, where)
      return DataParallelState(
          comm=self.init_comm(_values(params)), inner=inner
      )

    def update_fn(updates, state, params=None, **extra_args):
      _checks.check_optimizer_after(state.inner, where)
      updates = _local_grads.stacked(updates)
      if params is not None:
        _local_grads.check_stacked(updates, params, self.num_devices)
      mean, comm, finite = self._compress(updates, state.comm)
      return self._inner_update(
          tx, mean, comm, finite, state, params, extra_args
      )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

  def _inner_update(
      self,
      tx: optax.GradientTransformation,
      mean: Any,
      comm: Any,
      finite: jax.Array,
      state: DataParallelState,
      params: Any,
      extra_args: dict[str, Any],
  ) -> tuple[Any, DataParallelState]:
    """``chain(tx)``'s update after the exchange; with ``nonfinite="skip"``
    the whole step is undone where the mean is not finite."""
    updates, inner = tx.update(mean, state.inner, params, **extra_args)
    if self.nonfinite == "skip":
      inner = phase_lib.where(finite, inner, state.inner)
      updates = jax.tree.map(lambda u: jnp.where(finite, u, 0), updates)
    return updates, DataParallelState(comm=comm, inner=inner)

  def step(
      self,
      tx: optax.GradientTransformation,
      blocks: Any,
      *,
      overlap: bool = False,
  ) -> Callable[..., tuple[Any, DataParallelState, jax.Array]]:
    """A whole training step of a model given as blocks, overlapped or fused.

    ``step(params, opt_state, *batch) -> (params, opt_state, loss)``, with
    ``opt_state`` from ``chain(tx).init(params)`` and ``loss`` the mean of
    the devices' losses. Each batch argument is split over the devices along
    its leading axis. ``params`` and ``opt_state`` are donated.

    Overlapped (``acp_jax.overlap``), each block's gradients are exchanged
    on a communication thread while the next block's backward pass runs,
    an overlap XLA:CPU gives no collective within one program; fused, it is
    one jitted program. Both give the same result to float32 rounding.

    Args:
      tx: the optimizer fed with the compressed mean, as in ``chain(tx)``.
      blocks: the model as a sequence of functions ``block(params, carry,
        *batch) -> carry`` of the whole params tree: the first takes
        ``carry=None``, the last returns this device's scalar loss.
      overlap: True for the overlapped step, False (the default) for the
        fused one. Overlap pays in multi-process runs with one CPU device
        per process where both the exchange and the backward pass are a
        good part of the step; elsewhere it is slower
        (``benchmarks/results/REPORT.md``, section 4; ``python -m
        benchmarks overlap_step`` measures yours). Where the blocks cannot
        be split, the step is fused, with a warning on the
        ``acp_jax.overlap`` logger.
    """
    return overlap_lib.make_step(self, tx, blocks, overlap)

  # -- gradients ---------------------------------------------------------------

  def value_and_grad(
      self,
      fun: Callable[..., Any],
      *,
      has_aux: bool = False,
      aux_specs: Any = None,
      batch_specs: Any = None,
      normalize: str = "device",
      batch_norm: str = "global",
  ) -> Callable[..., tuple[Any, LocalGrads]]:
    """Like ``jax.value_and_grad(fun)``, each device on its own batch shard.

    ``fun(params, *batch)`` is the loss of one device's shard. ``params`` is
    a pytree, or a Flax NNX module (then gradients are taken of its
    ``nnx.Param`` variables, and its other state, e.g. BatchNorm
    statistics, is updated with floating values averaged over the devices).

    Each argument after the first is split over the device axes along the
    axis its ``batch_specs`` entry names. Without one, an array placed with
    a ``NamedSharding`` over the device axes splits as placed (seen for
    concrete arrays, and under ``jit`` on ``Explicit`` axes only), a scalar
    goes whole to every device, and any other array splits along axis 0.
    The call is refused where such assumed axes 0 disagree in size with the
    other split axes (BatchNorm statistics beside a batch), or where no
    placement shows and the shapes read as well time-major (a ``(T, B, F)``
    batch beside ``(T, B)`` labels); ``(B, T)`` tokens and targets split
    along axis 0.

    Randomness differs per device: the device's index is folded into every
    PRNG key all devices receive alike (an NNX module's ``Rngs`` streams,
    key arguments given whole), and the module keeps the unfolded key. A
    batch of keys split over the devices is passed as it is; a key that
    ``fun`` closes over is not seen: pass it as an argument.

    The loss is averaged over the devices, as DDP does: wrong for a mean
    over a count that differs per shard (padding masks, tokens, weights).
    Then have ``fun`` return ``(sum, count)`` and pass
    ``normalize="global"``: the loss is ``psum(sum) / psum(count)``,
    exactly the plain loop's.

    An ``nnx.BatchNorm`` without an ``axis_name`` (and not
    ``use_running_average``) takes the device axes for the call, so it
    normalises over the global batch; ``batch_norm="local"`` keeps each
    device's own statistics, as DDP does without ``SyncBatchNorm``. A Flax
    Linen ``nn.BatchNorm`` is not seen: give it ``axis_name``.

    Args:
      fun: the loss, returning a scalar (or ``(loss, aux)`` with
        ``has_aux``); with ``normalize="global"``, ``(sum, count)`` in place
        of the scalar.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      aux_specs: the layout of ``aux``: a prefix tree of ``device_spec``
        (stacked per device; the default) and ``P()`` (identical on every
        device, returned once; refused at trace time where computed from
        the device's shard with no collective over the device axes).
      batch_specs: None, or per argument after the params: None (split as
        above), a ``PartitionSpec`` prefix tree naming the device axes on
        the axis to split (``P(None, "data")`` for a time-major
        ``(T, B, ...)`` batch), or ``P()`` (whole to every device, e.g. a
        Linen ``batch_stats`` argument).
      normalize: ``"device"`` (the mean of the devices' losses) or
        ``"global"`` (``fun`` returns ``(sum, count)``, the count not
        differentiated), as above.
      batch_norm: ``"global"`` or ``"local"``, as above.

    Returns:
      A function returning ``(value, local_grads)``: ``value`` is the loss
      averaged over devices, or ``(loss, aux)`` with ``has_aux``;
      ``local_grads`` is a ``LocalGrads``, each device's gradients stacked
      on a leading axis, not communicated. Hand them to ``chain(tx)``, or add
      up several micro-batches' first with ``+`` (one compressed send).
    """
    _checks.choice("normalize", normalize, NORMALIZATIONS)
    _checks.choice("batch_norm", batch_norm, BATCH_NORMS)
    if batch_norm == "global":
      fun = _loss.normalising_globally(fun, self.device_axes)

    def compute(params, *batch):
      specs = _specs.batch_specs(
          batch, batch_specs, self.device_spec, self.num_devices
      )
      loss = _loss.naming_assumed_splits(
          fun, batch, specs, batch_specs, self.device_spec[0]
      )
      if has_aux and aux_specs is not None:
        loss = _loss.with_replicated_aux_checked(
            loss, aux_specs, specs, self.device_axes
        )
      if normalize == "global":
        loss = _loss.globally_normalized(loss, has_aux, self.device_axes)
      return _local_grads.value_and_grad(
          self,
          loss,
          has_aux=has_aux,
          aux_specs=aux_specs,
          batch_specs=batch_specs,
      )(params, *batch)

    return compute


def _all_finite(arrays: list[jax.Array]) -> jax.Array:
  """Whether every element of ``arrays`` is finite: the sum of ``x - x`` is 0
  then, NaN otherwise, and never overflows. XLA keeps ``x - x`` for floats
  and reduces it in one pass that only reads ``x``, where
  ``jnp.isfinite(x).all()`` also writes a mask (and ``x * 0`` reads a
  broadcast zero array beside it on XLA:CPU)."""
  zeros = [jnp.sum((x - x).astype(jnp.float32)) for x in arrays]
  return jnp.isfinite(sum(zeros, jnp.float32(0)))
