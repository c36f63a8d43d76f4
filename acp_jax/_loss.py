"""The wrappers ``DataParallel.value_and_grad`` puts around a user's loss."""

from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from acp_jax import _checks
from acp_jax import _local_grads
from acp_jax import _specs


def naming_assumed_splits(
    fun: Callable[..., Any], batch: tuple, specs: tuple, given: Any, axis: Any
) -> Callable[..., Any]:
  """``fun``, whose ``TypeError`` or ``ValueError`` carries a note naming the
  arguments split along axis 0 by assumption: one that is not a batch
  (Linen ``batch_stats`` with channels equal to the batch size) splits
  without an error of ours and fails inside the loss."""
  given = (None,) * len(batch) if given is None else given
  assumed = [
      f"argument {i + 1} {[tuple(np.shape(x)) for x in jax.tree.leaves(arg)]}"
      for i, (arg, arg_specs, entry) in enumerate(zip(batch, specs, given))
      if entry is None
      and not all(
          _specs.is_replicated(spec)
          for spec in jax.tree.leaves(arg_specs, is_leaf=_specs.is_spec)
      )
  ]
  if not assumed:
    return fun

  def named(params, *args):
    try:
      return fun(params, *args)
    except (TypeError, ValueError) as e:
      # A note, not a new error: only the loss knows whether its error is
      # about these shapes.
      e.add_note(
          "acp_jax: value_and_grad split along axis 0 by assumption"
          f" {', '.join(assumed)} (shapes before the split). If the loss"
          " failed on their shapes: an argument that is not a batch (e.g."
          " Linen batch_stats, whose channels may equal the batch size) goes"
          " whole to every device with batch_specs=(..., P(), ...), one"
          " entry per argument after the params; a time-major one splits"
          f" with P(None, {axis!r})."
      )
      raise

  return named


def with_replicated_aux_checked(
    fun: Callable[..., Any], aux_specs: Any, specs: tuple, axes: tuple
) -> Callable[..., Any]:
  """``fun``, refusing at trace time a ``P()`` ``aux`` leaf (one value for
  all devices) computed from this device's shard with no collective over
  ``axes``: ``shard_map`` would return device 0's value as everyone's."""

  def checked(params, *batch):
    loss, aux = fun(params, *batch)
    paired = jax.tree.map(
        lambda spec, a: [(spec, x) for x in jax.tree.leaves(a)],
        aux_specs,
        aux,
        is_leaf=_specs.is_spec,
    )
    pairs = jax.tree.leaves(paired, is_leaf=lambda p: isinstance(p, tuple))
    if all(spec != P() for spec, _ in pairs):
      return loss, aux
    own = [False] * len(jax.tree.leaves(params))
    for arg, arg_specs in zip(batch, specs):
      leaves = jax.tree.leaves(arg)
      split = [
          not _specs.is_replicated(spec)
          for spec in jax.tree.leaves(arg_specs, is_leaf=_specs.is_spec)
      ]
      own += (split + [False] * len(leaves))[: len(leaves)]
    varying = _checks.varying_outputs(
        lambda *args: jax.tree.leaves(fun(*args)[1]), (params, *batch), own,
        axes,
    )
    for (spec, x), differs in zip(pairs, varying):
      if spec == P() and differs:
        raise ValueError(
            "value_and_grad: aux_specs gives P() (one value for all"
            f" devices) to an aux value of shape {jnp.shape(x)} that is"
            " computed from this device's shard of the batch, with no"
            " collective over the device axes: every device holds its own,"
            " and P() would return device 0's. Average it inside the loss"
            f" (lax.pmean(value, {axes!r})), or leave aux_specs at its"
            " default, which returns every device's value stacked."
        )
    return loss, aux

  return checked


def normalising_globally(
    fun: Callable[..., Any], axes: tuple[str, ...]
) -> Callable[..., Any]:
  """``fun(model, *batch)`` with the axis-less ``nnx.BatchNorm`` layers of
  an NNX ``model`` averaging their batch statistics over ``axes``; on the
  copy the step merges in its trace, not the user's module."""

  def loss(model, *batch):
    nnx = _local_grads.flax_nnx()
    if nnx is not None and isinstance(model, nnx.Module):
      for _, node in nnx.iter_graph(model):
        if (
            isinstance(node, nnx.BatchNorm)
            and node.axis_name is None
            and not node.use_running_average
        ):
          node.axis_name = axes
    return fun(model, *batch)

  return loss


def globally_normalized(
    fun: Callable[..., Any], has_aux: bool, axes: tuple[str, ...]
) -> Callable[..., Any]:
  """``fun``, which returns its shard's ``(sum, count)``, as a loss whose
  mean over the devices is ``psum(sum) / psum(count)``: each device's
  ``sum * num_devices / psum(count)``, under ``shard_map`` over ``axes``."""

  def loss(params, *batch):
    out = fun(params, *batch)
    value, aux = out if has_aux else (out, None)
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      raise TypeError(
          'value_and_grad(..., normalize="global") needs a loss returning'
          " (sum, count) of its shard (with has_aux, ((sum, count), aux)),"
          f" got {type(value).__name__}"
      )
    total, count = value
    count = lax.psum(lax.stop_gradient(jnp.asarray(count, total.dtype)), axes)
    local = total * (lax.psum(1, axes) / count)
    return (local, aux) if has_aux else local

  return loss
