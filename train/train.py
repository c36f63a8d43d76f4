"""The train and eval steps and the loop: data-parallel training with a
gradient compressor on the state that ``experiment.build`` lays out.

The compressor runs through ``acp_jax.DataParallel``, which owns its layout
and the one compressed exchange per step.

``train_step`` differentiates each device's own local loss, hands the local
gradients to the compressor, and reduces the step's metrics (loss, correct,
weight, squared gradient norm, devices holding a non-finite state: 20 bytes)
with one small all-reduce. ``train_and_evaluate`` composes the loop from the
pieces in ``train/loop.py``: a step timer, the log, the failure policy,
periodic evaluation and checkpoints.
"""

import contextlib
import functools
import os
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import acp_jax
from train import data as data_lib
from train import loop
from train import loss as loss_lib
from train import metrics as metrics_lib
from train import pipeline
from train import runtime
from train.experiment import AXIS
from train.experiment import batch_stats_spec
from train.experiment import build
from train.experiment import DEVICE
from train.experiment import Experiment
from train.experiment import init_state
from train.experiment import put_batch
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
    loss_min: jax.Array | None = None,
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

  With ``divergence_factor`` and ``loss_min`` (the lowest loss of the steps
  before, float32 []; inf before the first), ``diverged`` is 1.0 where the
  loss exceeds their product, and ``loss_min`` comes back with this step's
  loss taken in (unless it is skipped). The loss is the global mean, so
  every process decides alike; with ``skip_nonfinite`` a diverged step is
  skipped as a non-finite one is.
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
      loss_min=loss_min,
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
    loss_min: jax.Array | None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """``train_step``'s divergence test and non-finite skip (see there): the
  state the step keeps, and its metrics with ``diverged``, ``skipped`` and
  ``loss_min`` added where they apply."""
  diverged = jnp.bool_(False)
  if loss_min is not None and divergence_factor:
    diverged = metrics["loss"] > divergence_factor * loss_min
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
  if loss_min is not None:
    metrics["loss_min"] = jnp.where(
        keep, jnp.minimum(loss_min, metrics["loss"]), loss_min
    )
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


def _is_finite(experiment: Experiment, state: TrainState) -> bool:
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


def evaluate(experiment, eval_fn, state) -> dict[str, float]:
  config, source = experiment.config, experiment.dataset.eval
  read = functools.partial(
      data_lib.eval_batch,
      source,
      global_batch=experiment.global_batch,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )
  totals = np.zeros(3)
  with pipeline.batches(
      read,
      0,
      data_lib.num_eval_batches(source, experiment.global_batch),
      workers=config.data_workers,
      prefetch=config.data_prefetch,
  ) as batches:
    for batch in batches:
      sums = eval_fn(
          state.params, state.batch_stats, put_batch(experiment, batch)
      )
      totals += np.asarray(jax.device_get(sums))
  loss, correct, weight = totals
  return {"eval_loss": loss / weight, "eval_accuracy": correct / weight}


def run_identity(experiment: Experiment, state: TrainState) -> dict[str, Any]:
  """What a checkpoint must share with this run to be resumed by it."""
  config = experiment.config
  name = config.compressor.name
  args = config.compressor.get(name)
  return {
      "compressor": {
          "name": name,
          "args": args.to_dict() if args is not None else {},
      },
      "optimizer": config.optimizer.name,
      "model": config.model.to_dict(),
      "batch_norm": config.batch_norm,
      # The data order: a record's data position holds only with both.
      "batch_size": experiment.global_batch,
      "seed": config.seed,
      "devices": experiment.num_devices,
      "processes": jax.process_count(),
      "params": {
          jax.tree_util.keystr(path): list(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(state.params)
      },
  }


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str
) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``, resuming from its latest checkpoint.

  Returns:
    A summary: final step, last train and eval metrics, bytes per step, the
    steady-state throughput and a digest of the final params.
  """
  runtime.check_same_config(config)
  experiment = build(config)
  os.makedirs(workdir, exist_ok=True)
  runtime.check_shared_workdir(workdir)
  with runtime.WorkdirLock(workdir):
    return _train(experiment, workdir)


def _train(experiment: Experiment, workdir: str) -> dict[str, Any]:
  """``train_and_evaluate`` in a workdir this run holds."""
  config = experiment.config
  loader = data_lib.Loader(
      experiment.dataset.train,
      global_batch=experiment.global_batch,
      seed=config.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      augment=config.augment,
  )
  # The pieces of the loop (train/loop.py), each holding its own state.
  train_fn, eval_fn = compile_steps(experiment)
  checkpoints, state, start, loss_min = _resume(experiment, workdir, loader)
  evaluation = loop.Evaluation(
      config, functools.partial(evaluate, experiment, eval_fn)
  )
  timer = loop.StepTimer()
  # XLA:CPU's simulated devices can deadlock in a collective's rendezvous
  # with several steps in flight on few cores: there each step is waited for.
  wait = jax.default_backend() == "cpu"
  with contextlib.ExitStack() as stack:
    stack.callback(checkpoints.close)
    log = stack.enter_context(loop.TrainLog(experiment, workdir, start))
    steps = loop.StepRecorder(
        timer, loop.FailurePolicy(config, checkpoints), log
    )
    stops = stack.enter_context(runtime.StopRequests())
    # Batch `index` is loader.batch(index), whoever computes it: a resumed
    # run starts the pipeline at its step.
    batches = stack.enter_context(
        pipeline.batches(
            loader.batch,
            start,
            config.num_train_steps,
            workers=config.data_workers,
            prefetch=config.data_prefetch,
        )
    )
    for index, batch in zip(range(start, config.num_train_steps), batches):
      step = index + 1
      # Out of a compressor's dense warm-up when it ends (else a no-op).
      state = state._replace(
          opt_state=experiment.dp.at_step(state.opt_state, index)
      )
      state, metrics = train_fn(
          state, put_batch(experiment, batch), loss_min=loss_min
      )
      loss_min = metrics["loss_min"]
      if wait:
        jax.block_until_ready(state)
        timer.completed(step)
      steps.push(step, metrics)
      stop = stops.should_stop(step)
      _between_steps(
          step, state, stop, steps, evaluation, log, checkpoints, timer
      )
      if stop:
        raise runtime.Interrupted(stops.signal_name, step)
    steps.flush()
  return _summary(experiment, state, steps.latest, evaluation, timer)


def _resume(experiment: Experiment, workdir: str, loader):
  """The checkpoints of ``workdir`` and what they restore: the state, its
  step and the divergence guard's running minimum, kept on the devices."""
  state = init_state(experiment)
  checkpoints = loop.Checkpoints(
      experiment, workdir, run_identity(experiment, state), loader
  )
  state, start = checkpoints.restore(
      state, functools.partial(_is_finite, experiment)
  )
  loss_min = jax.device_put(
      np.float32(checkpoints.loss_min),
      NamedSharding(experiment.mesh, REPLICATED),
  )
  return checkpoints, state, start, loss_min


def _between_steps(
    step, state, stop, steps, evaluation, log, checkpoints, timer
):
  """After ``step``: the evaluation and the checkpoint that are due (or that
  a stop request makes due), with the metrics read first and the step timer
  paused over them."""
  if evaluation.due(step) or checkpoints.due(step) or stop:
    steps.flush()
    if evaluation.due(step):
      log.evaluation(step, evaluation(state))
    if checkpoints.due(step) or stop:
      checkpoints.save(step, state, steps.latest)
    timer.pause()


def _summary(experiment, state, metrics, evaluation, timer) -> dict[str, Any]:
  """What ``train_and_evaluate`` returns."""
  bytes_per_step = experiment.bytes_per_step()
  eval_metrics = evaluation.latest or evaluation(state)
  # The first step of each phase compiles; the median skips them.
  seconds = timer.median_after(len(bytes_per_step))
  return {
      "step": int(state.step),
      "compressor": experiment.config.compressor.name,
      **{k: v for k, v in metrics.items() if k not in loop.GUARD},
      **eval_metrics,
      "bytes_per_step": statistics.mean(bytes_per_step),
      "bytes_per_phase": bytes_per_step,
      "bytes_sent": experiment.bytes_through(int(state.step)),
      "examples_per_sec": (
          experiment.global_batch / seconds if seconds else None
      ),
      "num_devices": experiment.num_devices,
      "params_sha256": metrics_lib.params_digest(state.params),
  }
