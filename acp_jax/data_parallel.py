"""Compressed data parallelism over a device mesh, beside the user's optimizer.

The JAX counterpart of PyTorch DDP with a communication hook: the compressor
and its state live beside whatever optimizer the user already has, not
inside it. ``DataParallel`` owns the three things a compressed data-parallel
step needs and a plain ``jit`` + ``NamedSharding`` loop does not have:

- each device's own gradient: ``value_and_grad`` differentiates every
  device's shard of the batch under ``jax.shard_map`` (``check_vma=False``,
  so ``jax.grad`` inserts no dense all-reduce of its own) and returns the
  local gradients stacked on a leading device axis, sharded, moved nowhere,
  as a ``LocalGrads`` that no transform but ``chain(tx)`` accepts;
- the state layout: the compressor's per-device fields (the residuals) are
  stacked on that axis, everything else (its factors, the ACP-SGD phase, the
  optimizer's state) is stored once, replicated;
- the one compressed exchange: ``chain(tx)`` runs the compressor on the local
  gradients under ``jax.shard_map`` and hands their mean to ``tx``.

It works on any mesh that has the compressor's axis, across processes under
``jax.distributed`` too, for pytrees of params and for Flax NNX modules.

Hierarchical: with ``local_axis``, the mesh is nodes x devices per node, as
in a cluster of multi-GPU hosts on a slow network. The batch is split over
both axes; the exchange first averages the gradients densely within each
node (``lax.pmean`` over ``local_axis``: NVLink or PCIe, cheap), then runs
the compressor across nodes over its ``axis_name`` (the slow network). The
residuals are then identical within a node, so they are stored once per
node: sharded over the node axis, replicated over the local one. So is every
buffer the compressor sends, so the node's devices share the sending: each
runs the collective across nodes on its own chunk of each buffer, and the
chunks are gathered back over the local axis (``collectives.split_over``).
A node's link then carries the compressed bytes once, not once per device.

This module is the one class ``DataParallel``, about half of it docstrings;
the pieces it is made of live apart: ``_layout`` (where each array lives on
the mesh), ``_local_grads`` (the ``LocalGrads`` type and the per-device
gradient program), ``_specs`` (how the batch arguments split over the
devices) and ``_accounting`` (what ``comm_bytes`` records).
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
    comm: the compressor's state. Its ``local_fields`` (the residuals) carry
      a leading axis of one slice per device (per node, when hierarchical),
      sharded over the compressor's axis; its other fields are replicated.
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
      (and ``local_axis``). Other axes (model parallelism) are not data
      axes: params sharded over them are gathered whole for each step, by
      collectives that ``comm_bytes`` does not count (it warns).
    local_axis: None, or an axis of ``mesh`` over which gradients are first
      averaged densely, before the compressor runs over its ``axis_name``
      (then the node axis): hierarchical compression, dense within a host
      and compressed across hosts.
    nonfinite: what a step does whose mean gradient is not finite (a
      non-finite gradient on any device makes it so on every device).
      ``"keep"``: the compressor's state stays as it was (residuals, factors,
      step count; ACP-SGD's phase, a shape, still advances, and the next
      step projects on the factor of the last step taken), and the mean goes
      on to ``tx`` as S-SGD's would: ``dp.chain(optax.apply_if_finite(tx,
      n))`` then skips it as it does without compression. ``"skip"``: the
      whole step is skipped, ``tx``'s state kept too and the updates zero,
      without ``optax.apply_if_finite``. ``"propagate"``: no check, the
      residuals take the non-finite values (and every later step's).
      Each is a select on every replica alike, no conditional, no byte sent;
      on XLA:CPU, keeping a low-rank residual costs one copy of it per step
      (two passes over each compressed matrix, ``tests/
      test_lowrank_arithmetic.py``); ``"propagate"`` saves them.

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
      fun: None, or the loss as given to ``value_and_grad``; then with
        ``batch`` (arrays or their shapes) it tells which params the loss
        never reads. Their gradient is a zero that XLA knows at compile
        time, and it folds away a collective that sends only such values
        (the dense all-reduce of an unused layer under S-SGD, or of its
        bias under Power-SGD and ACP-SGD), so they are left out where the
        compiled step leaves them out; their compressed factors, computed
        from a residual, are still sent and counted. Without ``fun``,
        every param counts as read.
        With ``fun``, the step's other all-reduces count too, on the
        compressor's axis: those of ``value_and_grad(fun)`` but the loss's
        mean (BatchNorm's statistics and their gradient, a module's state
        averaged after the step, collectives of ``fun``'s own).
      *batch: the arguments after the params of ``fun``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      batch_norm: as given to ``value_and_grad``; ``"global"`` sends the
        statistics of each ``nnx.BatchNorm``.

    Returns:
      ``{axis name: {phase: CommVolume}}`` with the phase names of
      ``acp_jax.comm_bytes``. Without ``local_axis``, the compressor's own
      accounting among ``num_devices`` participants. With it, on the
      compressor's axis what each device sends of its chunks of the
      compressor's buffers among ``num_nodes`` nodes, and on ``local_axis``
      the dense all-reduce of every gradient plus the all-gathers that put
      the chunks back together: the collectives that the step's trace
      makes (``collectives.recording``), traced on shapes only. The loss
      that ``value_and_grad`` averages (4 bytes, over all axes) is not
      counted, nor are collectives over the mesh's other axes: params
      sharded over one (model parallelism) are all-gathered whole for the
      step, which warns here.
    """
    _checks.choice("batch_norm", batch_norm, BATCH_NORMS)
    return _accounting.step_volumes(
        self, params, fun, batch, has_aux=has_aux, batch_norm=batch_norm
    )

  def at_step(self, opt_state: Any, step: int) -> Any:
    """``opt_state`` set to run step ``step`` (counted from 0): for a
    compressor with a dense warm-up (``warmup_steps``), the loop calls it
    before every step (see ``Compressor.at_step``); otherwise it is the
    identity.

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
    and copies them first. A step that donates the params with the state
    pairs them rightly.

    Args:
      local_grads: each device's gradient, stacked on a leading axis sharded
        over the device axes (``value_and_grad``'s ``LocalGrads.stacked``).
      comm_state: the compressor's state, from ``init_comm``.

    Returns:
      ``(mean, comm_state)``: the (approximate) mean gradient, replicated, and
      the compressor's next state (``comm_state`` itself, but for ACP-SGD's
      phase, where the mean is not finite, unless ``nonfinite`` is
      ``"propagate"``).
    """
    mean, comm_state, _ = self._compress(local_grads, comm_state)
    return mean, comm_state

  def _compress(
      self, local_grads: Any, comm_state: Any, unused: Any = None
  ) -> tuple[Any, Any, Any]:
    """``compress``, and whether the mean is finite (a replicated bool).
    ``unused``: None, or a flag per leaf whose gradient is then taken as
    zero, a constant, as XLA sees a param that the loss never reads
    (``comm_bytes`` traces it so)."""
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
        # A node's devices then hand the compressor the same gradient, so
        # their residuals stay identical: one copy per node.
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
    """The compressor's update on one device under ``shard_map``: of its
    ``grads``, from its ``[1, ...]`` blocks of the state, its collectives
    split as the context manager ``split`` says. Returns the mean, the new
    state and the old one (unstacked), and whether every float received is
    finite: a non-finite gradient on any device makes what it sends
    non-finite (its dense values, its factors, its top-k values, its sign
    scales), and so what every device receives: the same verdict on every
    replica, with not a byte more sent, from buffers much smaller than the
    mean for a compressor."""
    old = self._map_local(lambda x: x[0], blocks)
    with split, collectives.receiving() as received, _checks.placed():
      mean, state = self.compressor.update(grads, old)
    floats = [x for x in received if jnp.issubdtype(x.dtype, jnp.inexact)]
    return mean, state, old, _all_finite(floats)

  def chain(
      self, tx: optax.GradientTransformation
  ) -> optax.GradientTransformation:
    """``tx`` fed with the compressed mean of the devices' gradients.

    The returned transformation's ``update`` takes the ``LocalGrads`` of
    ``value_and_grad``; its state is a ``DataParallelState``. Any other
    transform (clipping, weight decay) goes inside, in ``tx``: it then sees
    the compressed mean, as DDP users' clipping sees the all-reduced one.
    Use it where ``tx`` was used: ``tx.update`` in a jitted step, or
    ``nnx.Optimizer(model, dp.chain(tx), wrt=nnx.Param)``.

    A ``tx`` whose update of a gradient of ones is not finite or climbs it
    (a NaN, infinite or negative learning rate) is refused here, or by
    ``init`` where the probe needs the params' tree.
    ``init`` refuses a ``tx`` that holds ``optax.MultiSteps`` (the exchange
    before it would send at every micro-step: add micro-batches' local
    gradients with ``+`` instead).
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
    """``chain(tx)``'s update after the exchange: ``tx`` on the compressed
    ``mean``, and with ``nonfinite="skip"`` the whole step undone where the
    mean is not finite. ``comm`` is the compressor's next state."""
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
    its leading axis. ``params`` and ``opt_state`` are donated: use the ones
    the step returns.

    Overlapped (``acp_jax.overlap``), the backward pass runs block by block
    and each block's gradients are exchanged by the compressor as soon as
    they are complete, on a communication thread, while the next block's
    backward pass runs: the overlap of wait-free backpropagation, which
    XLA:CPU gives no collective within one program. Fused, it is one jitted
    program of ``value_and_grad`` and ``chain(tx)``'s update. Both give the
    same result to float32 rounding, from the same state: checkpoints,
    ``at_step`` and the compressor's phase are the same either way.

    Args:
      tx: the optimizer fed with the compressed mean, as in ``chain(tx)``.
      blocks: the model as a sequence of functions ``block(params, carry,
        *batch) -> carry`` of the whole params tree: the first takes
        ``carry=None``, the last returns this device's scalar loss. The
        overlapped step exchanges each block's params once its backward
        pass has completed their gradient.
      overlap: True for the overlapped step, False (the default) for the
        fused one. Overlap pays where XLA gives none itself, in multi-process
        runs with one CPU device per process, and where both the exchange
        and the backward pass are a good part of the step; where compute
        dominates, the extra programs and the communication thread make the
        step slower (``benchmarks/results/REPORT.md``, section 4, measures
        both on shaped links; ``python -m benchmarks overlap_step`` measures
        yours). On GPUs XLA overlaps the fused step's collectives itself,
        and simulated devices of one process run their programs in
        lockstep. Where the blocks cannot be split (one block holds every
        param, or the compressor draws random factors for all leaves at
        once), the step is fused, with a one-line warning on the
        ``acp_jax.overlap`` logger.
    """
    return overlap_lib.make_step(self, tx, blocks, overlap)

  # -- gradients ----------------------------------------------------------------

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
    a pytree, or a Flax NNX module (then ``fun(model, *batch)``; gradients
    are taken of its ``nnx.Param`` variables and its other state, e.g.
    BatchNorm statistics, is updated with floating values averaged over the
    devices).

    Each argument after the first is split over the mesh's device axes along
    the axis that its ``batch_specs`` entry names. Without one, an array
    placed with a ``NamedSharding`` over the device axes is split along the
    axis that sharding splits (JAX shows it for concrete arrays, and under
    ``jit`` on ``Explicit`` mesh axes only), a scalar goes whole to every
    device, and any other array is split along its leading axis. Where
    such assumed leading axes disagree in size with the other split axes
    (BatchNorm statistics beside a batch, a time-major sequence beside its
    labels), which axis is the batch is ambiguous, and the call is refused;
    so is it where nothing shows the placement (under ``jit`` on ``Auto``
    mesh axes) and the shapes read as well time-major: every split
    argument's axis 1 of one size that splits evenly, and axes 0 and 1 of
    one size, or an axis 0 of one row per device, or arguments of several
    ranks sharing axes 0 and 1 (a ``(T, B, F)`` batch beside ``(T, B)``
    labels). Arguments of one rank and of other sizes (tokens and targets
    ``(B, T)``) split along axis 0.

    Randomness differs per device, as in a loop over the whole batch: the
    device's index (over the device axes, as it stacks) is folded into every
    PRNG key that all devices receive alike, the keys of an NNX module's
    ``Rngs`` streams and key arguments that go whole to every device (e.g.
    ``fun(params, x, key)``), so that dropout masks and noise are drawn
    independently for every shard. The module keeps the unfolded key, and
    its streams' counts advance alike: the replicas stay identical. A batch
    of keys split over the devices is passed as it is, and a key that
    ``fun`` closes over is not seen: pass it as an argument.

    The loss is averaged over the devices, as DDP does: a loss that is a
    mean over its shard's rows gives the plain loop's mean over the global
    batch. A mean over a count that differs per shard (a mask of padding,
    tokens of a language model, weights) does not: each shard's mean
    counts as much whatever its count. For the global one, have ``fun``
    return the sum and the count, ``(sum, count)``, and pass
    ``normalize="global"``: the loss is then ``psum(sum) / psum(count)``,
    exactly the plain loop's (one more scalar all-reduce).

    BatchNorm normalises over the global batch, as in the plain loop: an
    ``nnx.BatchNorm`` of the module given without an ``axis_name`` (and
    not ``use_running_average``) takes the device axes as its
    ``axis_name`` for the call, so that its statistics are averaged over
    the devices (the mean and the mean of squares, and their gradient:
    256 B for 16 features in float32, which ``comm_bytes`` given the loss
    counts). ``batch_norm="local"`` keeps each
    device's own statistics, as PyTorch DDP does without
    ``SyncBatchNorm``. A Flax Linen ``nn.BatchNorm`` is not seen: give it
    ``axis_name``.

    Args:
      fun: the loss, returning a scalar (or ``(loss, aux)`` with
        ``has_aux``); with ``normalize="global"``, ``(sum, count)`` in place
        of the scalar.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      aux_specs: the layout of ``aux``: a prefix tree of ``device_spec``
        (stacked per device on a leading axis, nothing sent; the default)
        and ``P()`` (a value identical on every device, e.g. statistics
        synchronized by a collective inside ``fun``, returned once). A
        ``P()`` value that is computed from the device's batch shard with
        no collective over the device axes is refused at trace time.
      batch_specs: None, or one entry per argument after the params: None
        (split as above) or a ``PartitionSpec`` prefix tree of the argument
        naming the device axes on the axis to split (``device_spec`` for
        the leading one, ``P(None, "data")`` for a time-major ``(T, B, ...)``
        batch) or none at all (``P()``: every device gets it whole, e.g. a
        Linen ``batch_stats`` argument).
      normalize: ``"device"``: ``fun`` returns the loss of its shard, and
        the loss is their mean over the devices; ``"global"``: ``fun``
        returns ``(sum, count)`` of its shard (the count is not
        differentiated), and the loss is the sum over all devices divided
        by the count over all devices.
      batch_norm: ``"global"``: an NNX module's ``nnx.BatchNorm`` layers
        without an ``axis_name`` normalise over the global batch;
        ``"local"``: over each device's shard.

    Returns:
      A function returning ``(value, local_grads)``. ``value`` is the loss
      averaged over devices (one scalar all-reduce), or ``(loss, aux)`` with
      ``has_aux``. ``local_grads`` is a ``LocalGrads``: each device's
      gradients, stacked on a leading axis, sharded, not communicated. Hand
      them to ``chain(tx)`` (any other transform, clipping included, goes
      inside it and so sees their compressed mean), or add up several
      micro-batches' first with ``+`` (one compressed send for all).
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
  then, and NaN otherwise, and never overflows. XLA keeps ``x - x`` for
  floats (it is not 0 for inf and NaN) and reduces it in one pass that only
  reads ``x``, where ``jnp.isfinite(x).all()`` also writes a mask (and
  ``x * 0`` reads a broadcast zero array beside it on XLA:CPU)."""
  zeros = [jnp.sum((x - x).astype(jnp.float32)) for x in arrays]
  return jnp.isfinite(sum(zeros, jnp.float32(0)))
