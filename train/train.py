"""The training loop: ``train_and_evaluate`` composes the steps of
``train/steps.py`` with the pieces in ``train/loop.py``: a step timer, the
log, the failure policy, periodic evaluation and checkpoints.
"""

import contextlib
import functools
import os
import statistics
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from train import advice
from train import checks
from train import data as data_lib
from train import loop
from train import metrics as metrics_lib
from train import pipeline
from train import runtime
from train.experiment import build
from train.experiment import Experiment
from train.experiment import init_state
from train.experiment import put_batch
from train.experiment import REPLICATED
from train.experiment import TrainState
from train.steps import compile_steps
from train.steps import is_finite


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
      # Under it the schedule and other host-side numbers run in float64:
      # a float32 run resumed with it would not continue bit for bit.
      "JAX_ENABLE_X64": bool(jax.config.jax_enable_x64),
      "params": {
          jax.tree_util.keystr(path): list(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(state.params)
      },
  }


def state_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The settings beyond ``run_identity`` that shape the optimizer state
  (the optimizer's own arguments), keyed as an operator sets them: named
  when a checkpoint's state has another structure."""
  optimizer = config.optimizer
  return {
      "config": {
          "optimizer": {
              optimizer.name: dict(optimizer.get(optimizer.name, {}))
          },
      },
      **advice.settings(config),
  }


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str
) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``, resuming from its latest checkpoint.

  Returns:
    A summary: final step, last train and eval metrics, bytes per step, the
    steady-state throughput and a digest of the final params.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise checks.ConfigError(
        f"the workdir {workdir} is an existing file, not a directory: name a"
        " directory (it is made if missing)"
    )
  runtime.check_same_config(config)
  config = advice.resolve(config, workdir)
  experiment = build(config)
  os.makedirs(workdir, exist_ok=True)
  runtime.check_shared_workdir(workdir)
  with runtime.WorkdirLock(workdir):
    return _train(experiment, workdir)


def _train(experiment: Experiment, workdir: str) -> dict[str, Any]:
  """``train_and_evaluate`` in a workdir this run holds."""
  config = experiment.config
  loader = _loader(experiment)
  # The pieces of the loop (train/loop.py), each holding its own state.
  train_fn, eval_fn = compile_steps(experiment)
  checkpoints, state, start, loss_start = _resume(experiment, workdir, loader)
  evaluation = loop.Evaluation(
      config, functools.partial(evaluate, experiment, eval_fn)
  )
  timer = loop.StepTimer()
  target = loop.Target(config)
  # XLA:CPU's simulated devices can deadlock in a collective's rendezvous
  # with several steps in flight on few cores: there each step is waited for.
  wait = jax.default_backend() == "cpu"
  with contextlib.ExitStack() as stack:
    stack.callback(checkpoints.close)
    log = stack.enter_context(
        loop.TrainLog(experiment, workdir, start, checkpoints.run_id)
    )
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
    step = start
    try:
      for index, batch in zip(range(start, config.num_train_steps), batches):
        step = index + 1
        # Out of a compressor's dense warm-up when it ends (else a no-op).
        state = state._replace(
            opt_state=experiment.dp.at_step(state.opt_state, index)
        )
        state, metrics = train_fn(
            state, put_batch(experiment, batch), loss_start=loss_start
        )
        loss_start = metrics["loss_start"]
        if wait:
          with runtime.waiting_on_peers(step, checkpoints.last_good):
            jax.block_until_ready(state)
          timer.completed(step)
        steps.push(step, metrics)
        stop = stops.should_stop(step)
        _between_steps(
            step, state, stop, steps, evaluation, log, checkpoints, timer
        )
        if stop:
          raise runtime.Interrupted(stops.signal_name, step)
        if evaluation.step == step and target.reached(step, evaluation.latest):
          _save_at_target(step, state, steps, checkpoints)
          break
      steps.flush()
    except jax.errors.JaxRuntimeError as e:
      lost = runtime.peer_lost(e, step, checkpoints.last_good)
      if lost is None:
        raise
      raise lost from e
  summary = _summary(experiment, state, steps.latest, evaluation, timer)
  if target.loss is not None:
    summary["target_eval_loss"] = target.loss
    summary["target_step"] = target.step  # None: capped, not reached
  if config.nonfinite == "skip":
    summary["skipped_steps"] = steps.policy.skipped
    steps.policy.check_skipped(summary)
  return summary


def _loader(experiment: Experiment) -> data_lib.Loader:
  """This process's training batches, in the run's order."""
  config = experiment.config
  return data_lib.Loader(
      experiment.dataset.train,
      global_batch=experiment.global_batch,
      seed=config.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      augment=config.augment,
  )


def _resume(experiment: Experiment, workdir: str, loader):
  """The checkpoints of ``workdir`` and what they restore: the state, its
  step and the divergence guard's reference, the loss at the start of
  training, kept on the devices."""
  state = init_state(experiment)
  checkpoints = loop.Checkpoints(
      experiment,
      workdir,
      run_identity(experiment, state),
      loader,
      settings=state_settings(experiment.config),
  )
  state, start = checkpoints.restore(
      state, functools.partial(is_finite, experiment)
  )
  loss_start = jax.device_put(
      np.float32(checkpoints.loss_start),
      NamedSharding(experiment.mesh, REPLICATED),
  )
  return checkpoints, state, start, loss_start


def _between_steps(
    step, state, stop, steps, evaluation, log, checkpoints, timer
):
  """After ``step``: the evaluation and the checkpoint that are due (or that
  a stop request makes due), with the metrics read first and the step timer
  paused over them."""
  if evaluation.due(step) or checkpoints.due(step) or stop:
    steps.flush()
    if evaluation.due(step):
      with _peers(step, checkpoints, "the evaluation after"):
        metrics = evaluation(state)
      log.evaluation(step, {**metrics, "train_seconds": timer.total()})
    if checkpoints.due(step) or stop:
      _save(step, state, steps, checkpoints)
    timer.pause()


def _peers(step, checkpoints, what: str):
  """The watchdog over ``what`` is done after ``step`` (its evaluation, its
  checkpoint's save), which waits on the other processes."""
  return runtime.waiting_on_peers(
      step, checkpoints.last_good, f"{what} step {step}"
  )


def _save(step, state, steps, checkpoints) -> None:
  with _peers(step, checkpoints, "the checkpoint save after"):
    checkpoints.save(step, state, steps.latest, steps.policy.skipped)


def _save_at_target(step, state, steps, checkpoints) -> None:
  """Ends the run at ``step``, where it reached its target: its checkpoint,
  unless one was just saved."""
  if not checkpoints.due(step):
    _save(step, state, steps, checkpoints)


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
      "train_seconds": timer.total(),
      "num_devices": experiment.num_devices,
      "params_sha256": metrics_lib.params_digest(state.params),
  }
