"""The train and eval steps: data-parallel training with a gradient
compressor on the state that ``experiment.build`` lays out.

The compressor runs through ``acp_jax.DataParallel``, which owns its layout
and the one compressed exchange per step. ``train_step`` differentiates each
device's own local loss, hands the local gradients to the compressor, and
reduces the step's metrics (loss, correct, weight, squared gradient norm,
devices holding a non-finite state: 20 bytes) with one small all-reduce.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import acp_jax
from train import loop
from train import loss as loss_lib
from train.experiment import AXIS
from train.experiment import batch_stats_spec
from train.experiment import DEVICE
from train.experiment import Experiment
from train.experiment import REPLICATED
from train.experiment import state_parts
from train.experiment import TrainState


def _this_device(tree):
  """A device's ``[1, ...]`` block of a stacked tree, squeezed."""
  return jax.tree.map(lambda x: x[0], tree)


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    dp: acp_jax.DataParallel,
    tx: optax.GradientTransformation,
    batch_norm: str,
    skip_nonfinite: bool = False,
    divergence_factor: float = 0.0,
    loss_start: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One step on the global state: local gradients, compressed mean, base
  optimizer.

  The metrics carry the norms of the gradients, the update and the new
  params, and ``state_nonfinite``, the number of devices on which a
  floating array of the new state (params, BatchNorm statistics, the
  optimizer's and the compressor's state) holds a non-finite value, so that
  the loop can refuse a non-finite state before saving it. With
  ``skip_nonfinite``, a step whose loss, gradients, update or state are not
  finite leaves the state as it was (selected, not branched: no collective
  runs under a conditional); the step counter still advances, and so does
  ACP-SGD's phase (keeping the previous factors, a valid state).

  With ``divergence_factor`` and ``loss_start`` (the loss of the run's first
  step that was kept, float32 []; inf before it), ``diverged`` is 1.0 where
  the loss exceeds their product, and ``loss_start`` comes back set by the
  first kept step with a finite loss. A healthy run's loss stays below the
  loss it started from, however close to zero it gets later. The loss is
  the global mean, so every process decides alike; with ``skip_nonfinite``
  a diverged step is skipped as a non-finite one is.
  """

  stats_spec = batch_stats_spec(batch_norm)
  # Synchronized statistics agree across devices: returned once.
  (_, (batch_stats, sums)), grads = dp.value_and_grad(
      _local_loss(state, graphdef, stats_spec),
      has_aux=True,
      aux_specs=(stats_spec, DEVICE),
      batch_specs=(DEVICE, stats_spec),
  )(state.params, batch, state.batch_stats)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = TrainState(
      step=state.step + 1,
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
      rng=state.rng,
  )
  bad = _nonfinite_by_device(
      state_parts(new_state, dp, batch_norm), dp.num_devices
  )
  metrics = _step_metrics(sums, grads, updates, params, bad, dp.num_devices)
  return _guard(
      state,
      new_state,
      metrics,
      skip_nonfinite=skip_nonfinite,
      divergence_factor=divergence_factor,
      loss_start=loss_start,
  )


def _local_loss(state: TrainState, graphdef: nnx.GraphDef, stats_spec):
  """The loss ``train_step`` differentiates on each device's shard.

  It maps ``(params, batch, batch_stats)`` to the mean loss and, as aux, the
  new BatchNorm statistics and the sums ``[loss, correct, weight]``. The
  batch comes as ``[1, per_device, ...]`` blocks, local statistics stacked
  per device, synchronized ones whole; dropout's key is folded from the
  state's key, its step and the device index.
  """

  def loss_fn(params, batch, batch_stats):
    batch = _this_device(batch)
    if stats_spec == DEVICE:
      batch_stats = _this_device(batch_stats)
    rng = jax.random.fold_in(
        jax.random.fold_in(state.rng, state.step), jax.lax.axis_index(AXIS)
    )
    model = nnx.merge(graphdef, params, batch_stats)
    logits = model(batch["inputs"], train=True, rngs=nnx.Rngs(dropout=rng))
    loss_sum, correct, weight = loss_lib.weighted_sums(logits, batch)
    batch_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    return loss_sum / jnp.maximum(weight, 1.0), (
        batch_stats,
        jnp.stack([loss_sum, correct, weight]),
    )

  return loss_fn


def _step_metrics(
    sums, grads, updates, params, bad, num_devices: int
) -> dict[str, jax.Array]:
  """The step's metrics from per-device partial sums (``sums``
  ``[loss, correct, weight]``, the squared norms of the local ``grads``,
  the non-finite flags ``bad``), reduced by one small all-reduce."""
  grad_sq = sum(
      jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
      for g in jax.tree.leaves(grads.stacked)
  )
  loss_sum, correct, weight, grad_sq, state_nonfinite = jnp.sum(
      jnp.concatenate([sums, grad_sq[:, None], bad[:, None]], axis=1), axis=0
  )
  return {
      "loss": loss_sum / weight,
      "accuracy": correct / weight,
      # Root mean square over devices of the local gradients' norms: the
      # norm of their mean would need the dense all-reduce we avoid.
      "grad_norm": jnp.sqrt(grad_sq / num_devices),
      "update_norm": optax.tree.norm(updates),
      "param_norm": optax.tree.norm(params),
      "state_nonfinite": state_nonfinite,
  }


def _guard(
    state: TrainState,
    new_state: TrainState,
    metrics: dict[str, jax.Array],
    *,
    skip_nonfinite: bool,
    divergence_factor: float,
    loss_start: jax.Array | None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """``train_step``'s divergence test and non-finite skip (see there): the
  state the step keeps, and its metrics with ``diverged``, ``skipped`` and
  ``loss_start`` added where they apply."""
  diverged = jnp.bool_(False)
  if loss_start is not None and divergence_factor:
    diverged = metrics["loss"] > divergence_factor * loss_start
    metrics["diverged"] = diverged.astype(jnp.float32)
  keep = jnp.bool_(True)
  if skip_nonfinite:
    checked = jnp.stack([metrics[k] for k in loop.FINITE_METRICS])
    keep = (
        jnp.all(jnp.isfinite(checked))
        & (metrics["state_nonfinite"] == 0)
        & ~diverged
    )
    new_state = acp_jax.phase.where(
        keep, new_state._replace(step=state.step), state
    )._replace(step=state.step + 1)
    metrics["skipped"] = 1 - keep.astype(jnp.float32)
  if loss_start is not None:
    first = ~jnp.isfinite(loss_start) & keep & jnp.isfinite(metrics["loss"])
    metrics["loss_start"] = jnp.where(first, metrics["loss"], loss_start)
  return new_state, metrics


def _nonfinite_by_device(parts, num_devices: int) -> jax.Array:
  """Per device, 1.0 where it holds a non-finite element of a floating array
  of ``parts`` (``(spec, tree)`` pairs, each tree laid out by its spec), else
  0.0: float32 [num_devices].

  Each array is reduced where it lies, a stacked one along each device's own
  slice, so the flags ride in the metrics' all-reduce with no collective of
  their own.
  """
  bad = jnp.zeros(num_devices, bool)
  for spec, tree in parts:
    for x in jax.tree.leaves(tree):
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        continue
      finite = jnp.isfinite(x)
      if spec == DEVICE:
        bad |= ~finite.all(axis=tuple(range(1, x.ndim)))
      else:
        bad |= ~finite.all()
  return bad.astype(jnp.float32)


def is_finite(experiment: Experiment, state: TrainState) -> bool:
  """Whether every floating array of ``state`` is finite, in every process
  alike (checked once, not per step: the step checks its own)."""
  dp, batch_norm = experiment.dp, experiment.config.batch_norm
  count = jax.jit(
      lambda state: _nonfinite_by_device(
          state_parts(state, dp, batch_norm), dp.num_devices
      ).sum()
  )(state)
  return not int(count)


def eval_step(
    params, batch_stats, batch, *, graphdef: nnx.GraphDef, batch_norm: str
) -> jax.Array:
  """Summed loss, correct predictions and weight over all devices' batches;
  each device evaluates its shard with its own (local) statistics."""
  if batch_norm != "sync":
    batch_stats = _this_device(batch_stats)
  batch = _this_device(batch)
  model = nnx.merge(graphdef, params, batch_stats)
  logits = model(batch["inputs"], train=False)
  return jax.lax.psum(jnp.stack(loss_lib.weighted_sums(logits, batch)), AXIS)


def compile_steps(experiment: Experiment):
  """The jitted train step and the mapped eval step."""
  config = experiment.config
  train_fn = jax.jit(
      functools.partial(
          train_step,
          graphdef=experiment.graphdef,
          dp=experiment.dp,
          tx=experiment.tx,
          batch_norm=config.batch_norm,
          skip_nonfinite=config.nonfinite == "skip",
          divergence_factor=config.get("divergence_factor") or 0.0,
      ),
      donate_argnums=(0,),
  )
  eval_fn = jax.jit(
      jax.shard_map(
          functools.partial(
              eval_step,
              graphdef=experiment.graphdef,
              batch_norm=config.batch_norm,
          ),
          mesh=experiment.mesh,
          in_specs=(REPLICATED, batch_stats_spec(config.batch_norm), DEVICE),
          out_specs=REPLICATED,
          check_vma=False,
      )
  )
  return train_fn, eval_fn
