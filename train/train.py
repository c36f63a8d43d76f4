"""Data-parallel training on a 1-D device mesh with a gradient compressor.

The state lives on the mesh in one layout for both mapping APIs: params (and
synchronized batch statistics) replicated; each device's own optimizer state
(error-feedback residuals differ across devices) and local batch statistics
stacked on a leading device axis, one slice per device. Batches are stacked
the same way, ``[devices, per_device_batch, ...]``.

``train_step`` is what one device runs. It differentiates its own local loss,
so the gradient it hands the compressor is the device's own: the compressor
does all the communication, plus one small all-reduce of the step's metrics
(and BatchNorm's statistics when ``config.batch_norm == "sync"``).
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import statistics
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from train import checkpoint
from train import config as config_lib
from train import data as data_lib
from train import models

AXIS = "data"
DEVICE = P(AXIS)  # stacked on a leading device axis, one slice per device
REPLICATED = P()
# Scalars all-reduced by every train step: loss, correct, weight, |grad|^2.
NUM_REDUCED_METRICS = 4


class TrainState(NamedTuple):
  step: jax.Array  # int32 [], updates applied so far
  params: Any  # nested dict of float32 arrays
  batch_stats: Any  # BatchNorm running statistics (empty without BN)
  opt_state: Any  # the chain's state, one per device
  rng: jax.Array  # uint32 [2], base key for dropout


def state_layout(batch_norm: str) -> TrainState:
  return TrainState(
      step=REPLICATED,
      params=REPLICATED,
      batch_stats=REPLICATED if batch_norm == "sync" else DEVICE,
      opt_state=DEVICE,
      rng=REPLICATED,
  )


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _on_device_slices(f, layout, tree):
  """``f`` on every leaf of ``tree`` that ``layout`` marks as stacked."""
  return jax.tree.map(
      lambda spec, sub: jax.tree.map(f, sub) if spec == DEVICE else sub,
      layout,
      tree,
      is_leaf=_is_spec,
  )


def map_per_device(
    fn: Callable,
    mesh: jax.sharding.Mesh,
    mapper: str,
    in_layout: tuple,
    out_layout: Any,
    donate_argnums: tuple[int, ...] = (),
) -> Callable:
  """``fn`` on each device's view of arguments in the mesh layout.

  ``in_layout`` (one entry per argument) and ``out_layout`` are prefix trees
  of ``DEVICE`` and ``REPLICATED``. Under ``jax.shard_map`` a device sees a
  ``[1, ...]`` block of a stacked array, which is squeezed; under
  ``jax.pmap`` the stacked axis is mapped (``in_axes=0``) and replicated
  values are broadcast (``in_axes=None``). Both compile to one program per
  distinct input structure.
  """
  if mapper == "pmap":
    axes = lambda layout: jax.tree.map(
        lambda s: 0 if s == DEVICE else None, layout, is_leaf=_is_spec
    )
    return jax.pmap(
        fn,
        axis_name=AXIS,
        in_axes=axes(in_layout),
        out_axes=axes(out_layout),
        donate_argnums=donate_argnums,
    )

  def body(*args):
    args = _on_device_slices(lambda x: x[0], in_layout, args)
    return _on_device_slices(lambda x: x[None], out_layout, fn(*args))

  # check_vma=False: with it, jax.grad of the replicated params would insert
  # a dense all-reduce of the gradient before the compressor sees it.
  return jax.jit(
      jax.shard_map(
          body,
          mesh=mesh,
          in_specs=in_layout,
          out_specs=out_layout,
          check_vma=False,
      ),
      donate_argnums=donate_argnums,
  )


def _weighted_sums(logits, batch):
  """Sums of loss, correct predictions and weight over the local batch."""
  weights = batch["weights"]
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]
  )
  correct = logits.argmax(-1) == batch["targets"]
  return (loss * weights).sum(), (correct * weights).sum(), weights.sum()


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One device's update: local gradient, compressed mean, base optimizer."""
  rng = jax.random.fold_in(
      jax.random.fold_in(state.rng, state.step), jax.lax.axis_index(AXIS)
  )

  def loss_fn(params):
    model = nnx.merge(graphdef, params, state.batch_stats)
    logits = model(batch["inputs"], train=True, rngs=nnx.Rngs(dropout=rng))
    loss_sum, correct, weight = _weighted_sums(logits, batch)
    batch_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    return loss_sum / jnp.maximum(weight, 1.0), (
        batch_stats,
        jnp.stack([loss_sum, correct, weight]),
    )

  (_, (batch_stats, sums)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params
  )
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_sq = sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads))
  loss_sum, correct, weight, grad_sq = jax.lax.psum(
      jnp.append(sums, grad_sq), AXIS
  )
  metrics = {
      "loss": loss_sum / weight,
      "accuracy": correct / weight,
      # Root mean square over devices of the local gradients' norms: the
      # norm of their mean would need the dense all-reduce we avoid.
      "grad_norm": jnp.sqrt(grad_sq / jax.lax.axis_size(AXIS)),
      "update_norm": optax.tree.norm(updates),
  }
  new_state = TrainState(
      step=state.step + 1,
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
      rng=state.rng,
  )
  return new_state, metrics


def eval_step(
    params, batch_stats, batch, *, graphdef: nnx.GraphDef
) -> jax.Array:
  """Summed loss, correct predictions and weight over all devices' batches."""
  model = nnx.merge(graphdef, params, batch_stats)
  logits = model(batch["inputs"], train=False)
  return jax.lax.psum(jnp.stack(_weighted_sums(logits, batch)), AXIS)


def sync_batch_norm_bytes(batch_stats: Any, batch_norm: str) -> int:
  """Bytes per device that synchronized BatchNorm all-reduces in one step.

  Each BN layer's forward pass all-reduces the mean and the mean of squares
  of its C channels (2C floats); the backward pass all-reduces their
  cotangents (2C more). Local BatchNorm sends nothing.
  """
  if batch_norm != "sync":
    return 0
  means = [
      x
      for path, x in jax.tree_util.tree_leaves_with_path(batch_stats)
      if jax.tree_util.keystr(path).endswith("['mean']")
  ]
  return sum(4 * x.size * x.dtype.itemsize for x in means)


@dataclasses.dataclass
class Experiment:
  """Everything built from a config before the first compilation."""

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  dataset: data_lib.Dataset
  create_model: Callable[[], nnx.Module]
  graphdef: nnx.GraphDef
  abstract_params: Any
  abstract_batch_stats: Any
  compressor: acp_jax.Compressor
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  global_batch: int
  ignored_compressor_args: list[str]

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  def bytes_per_step(self) -> list[int]:
    """Bytes each device sends per step, for each step of a phase cycle."""
    volumes = acp_jax.comm_bytes(
        self.compressor, self.abstract_params, num_devices=self.num_devices
    )
    overhead = 4 * NUM_REDUCED_METRICS + sync_batch_norm_bytes(
        self.abstract_batch_stats, self.config.batch_norm
    )
    return [v.total + overhead for v in volumes.values()]


def _model_kwargs(config, dataset) -> dict[str, Any]:
  """The model's arguments, its output size taken from the dataset."""
  kwargs = config_lib.kwargs(config.model)
  for key in ("num_classes", "vocab_size"):
    if key in kwargs and kwargs[key] != dataset.num_classes:
      raise ValueError(
          f"config.model.{key}={kwargs[key]} does not match the"
          f" {dataset.num_classes} of config.data.name={config.data.name!r}"
      )
  accepted = inspect.signature(models.MODELS[config.model.name]).parameters
  for key in ("num_classes", "vocab_size"):
    if key in accepted:
      kwargs[key] = dataset.num_classes
  return kwargs


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Checks ``config`` and builds everything but the compiled steps."""
  num_devices = jax.device_count()
  config_lib.validate(config, num_devices, jax.process_count())
  global_batch = config_lib.global_batch_size(config, num_devices)
  dataset = data_lib.build(config.data)
  model_kwargs = _model_kwargs(config, dataset)
  bn_axis = AXIS if config.batch_norm == "sync" else None

  def create():
    # XLA:CPU compiles threefry for each parameter shape in seconds (17 s
    # for a small CNN here); the RngBitGenerator-based "rbg" in 2.
    return models.create(
        config.model.name,
        rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")),
        batch_norm_axis=bn_axis,
        **model_kwargs,
    )

  graphdef, params, batch_stats = nnx.split(
      nnx.eval_shape(create), nnx.Param, nnx.BatchStat
  )
  compressor, ignored = config_lib.compressor(config, AXIS)
  schedule = config_lib.schedule(config)
  tx = optax.chain(compressor, config_lib.optimizer(config, schedule))
  return Experiment(
      config=config,
      mesh=jax.make_mesh(
          (num_devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
      ),
      dataset=dataset,
      create_model=create,
      graphdef=graphdef,
      abstract_params=nnx.to_pure_dict(params),
      abstract_batch_stats=nnx.to_pure_dict(batch_stats),
      compressor=compressor,
      tx=tx,
      schedule=schedule,
      global_batch=global_batch,
      ignored_compressor_args=ignored,
  )


def init_state(experiment: Experiment) -> TrainState:
  """The initial state, made on the devices in the mesh layout."""
  config, mesh = experiment.config, experiment.mesh
  layout = state_layout(config.batch_norm)

  @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, REPLICATED))
  def init_model():
    _, params, batch_stats = nnx.split(
        experiment.create_model(), nnx.Param, nnx.BatchStat
    )
    return nnx.to_pure_dict(params), nnx.to_pure_dict(batch_stats)

  params, batch_stats = init_model()

  def per_device(params, batch_stats):
    return batch_stats, experiment.tx.init(params)

  # Both mappers share the state layout; pmap cannot map a function of
  # replicated inputs only, so the state is always made by shard_map.
  batch_stats, opt_state = map_per_device(
      per_device,
      mesh,
      "shard_map",
      in_layout=(REPLICATED, REPLICATED),
      out_layout=(layout.batch_stats, layout.opt_state),
  )(params, batch_stats)
  return TrainState(
      step=jax.device_put(
          jnp.zeros((), jnp.int32), NamedSharding(mesh, REPLICATED)
      ),
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
      rng=jax.device_put(
          jax.random.PRNGKey(config.seed), NamedSharding(mesh, REPLICATED)
      ),
  )


def compile_steps(experiment: Experiment):
  """The mapped train and eval steps."""
  config = experiment.config
  layout = state_layout(config.batch_norm)
  train_fn = map_per_device(
      functools.partial(
          train_step, graphdef=experiment.graphdef, tx=experiment.tx
      ),
      experiment.mesh,
      config.mapper,
      in_layout=(layout, DEVICE),
      out_layout=(layout, REPLICATED),
      donate_argnums=(0,),
  )
  eval_fn = map_per_device(
      functools.partial(eval_step, graphdef=experiment.graphdef),
      experiment.mesh,
      config.mapper,
      in_layout=(REPLICATED, layout.batch_stats, DEVICE),
      out_layout=REPLICATED,
  )
  return train_fn, eval_fn


def put_batch(experiment: Experiment, local: dict[str, np.ndarray]):
  """This process's rows as a global ``[devices, per_device, ...]`` array."""
  n = experiment.num_devices
  per_device = experiment.global_batch // n
  sharding = NamedSharding(experiment.mesh, DEVICE)

  def put(x):
    x = x.reshape((-1, per_device) + x.shape[1:])
    return jax.make_array_from_process_local_data(
        sharding, x, (n,) + x.shape[1:]
    )

  return {k: put(v) for k, v in local.items()}


def abstract_batch(experiment: Experiment):
  """Shapes and shardings of a global batch, without moving one."""
  example = experiment.dataset.train.get(np.arange(1))
  per_device = experiment.global_batch // experiment.num_devices
  sharding = NamedSharding(experiment.mesh, DEVICE)
  return {
      k: jax.ShapeDtypeStruct(
          (experiment.num_devices, per_device) + v.shape[1:],
          v.dtype,
          sharding=sharding,
      )
      for k, v in example.items()
  }


def state_cycle(train_fn, state, batch) -> list[TrainState]:
  """Abstract states of consecutive steps until their structure repeats.

  ACP-SGD's state alternates between a P-phase and a Q-phase structure; the
  others keep one. Restoring a checkpoint needs the saved step's structure.
  """
  first = checkpoint.abstract(state)
  leaves = jax.tree.leaves(first)
  cycle = [first]
  current = first
  while True:
    current, _ = jax.eval_shape(train_fn, current, batch)
    treedef = jax.tree.structure(current)
    if treedef == jax.tree.structure(first):
      return cycle
    if len(cycle) > 4:
      raise RuntimeError("the optimizer state's structure does not cycle")
    cycle.append(jax.tree.unflatten(treedef, leaves))
    current = cycle[-1]


def params_digest(params) -> str:
  """SHA-256 of the params; raises if the replicas on this host differ."""
  digest = hashlib.sha256()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    if any(not np.array_equal(shards[0], s) for s in shards[1:]):
      raise RuntimeError(
          f"replicas of params{jax.tree_util.keystr(path)} differ across"
          " devices"
      )
    digest.update(shards[0].tobytes())
  return digest.hexdigest()


class MetricsLog:
  """``workdir/metrics.jsonl``, written by process 0 only."""

  def __init__(self, workdir: str, resume_step: int):
    self._path = os.path.join(workdir, "metrics.jsonl")
    self._active = jax.process_index() == 0
    if self._active and os.path.exists(self._path):
      # Lines past the restored checkpoint come from an interrupted run and
      # are about to be logged again.
      with open(self._path) as f:
        lines = [l for l in f if json.loads(l)["step"] <= resume_step]
      with open(self._path, "w") as f:
        f.writelines(lines)

  def write(self, record: dict[str, Any]) -> None:
    if self._active:
      with open(self._path, "a") as f:
        f.write(json.dumps(record) + "\n")


def evaluate(experiment, eval_fn, state) -> dict[str, float]:
  totals = np.zeros(3)
  for batch in data_lib.eval_batches(
      experiment.dataset.eval,
      global_batch=experiment.global_batch,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  ):
    sums = eval_fn(
        state.params, state.batch_stats, put_batch(experiment, batch)
    )
    totals += np.asarray(jax.device_get(sums))
  loss, correct, weight = totals
  return {"eval_loss": loss / weight, "eval_accuracy": correct / weight}


def _due(step: int, every: int, last: int) -> bool:
  return step == last or (every > 0 and step % every == 0)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str
) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``, resuming from its latest checkpoint.

  Returns:
    A summary: final step, last train and eval metrics, bytes per step, the
    steady-state throughput and a digest of the final params.
  """
  experiment = build(config)
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0
  loader = data_lib.Loader(
      experiment.dataset.train,
      global_batch=experiment.global_batch,
      seed=config.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      augment=config.augment,
  )
  train_fn, eval_fn = compile_steps(experiment)
  state = init_state(experiment)
  cycle = state_cycle(
      train_fn,
      state,
      abstract_batch(experiment),
  )
  ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints
  )
  start = ckpt.latest_step() or 0
  if start:
    state, record = ckpt.restore(start, cycle)
    assert record["step"] == start == int(state.step), (record, start)
  log = MetricsLog(workdir, start)
  bytes_per_step = experiment.bytes_per_step()
  last = config.num_train_steps
  on_cpu = jax.default_backend() == "cpu"
  durations, metrics, eval_metrics = [], {}, {}

  def record_step(step, device_metrics, seconds):
    nonlocal metrics
    metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    if not np.isfinite(metrics["loss"]):
      raise FloatingPointError(
          f"loss is {metrics['loss']} at step {step}; lower"
          " config.optimizer.learning_rate or check the data"
      )
    durations.append(seconds)
    if _due(step, config.log_every_steps, last):
      log.write(
          {
              "step": step,
              **metrics,
              "learning_rate": float(experiment.schedule(step - 1)),
              "bytes_sent": bytes_per_step[(step - 1) % len(bytes_per_step)],
              "examples_per_sec": experiment.global_batch / seconds,
          }
      )
    bar.update(1)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)

  # disable=None: a bar on a terminal only, none in redirected logs.
  bar = tqdm.tqdm(
      total=last,
      initial=start,
      disable=None if is_main else True,
      desc="train",
      leave=False,
  )
  pending = None  # metrics are read one step late: the host never stalls
  tick = time.perf_counter()
  for index in range(start, last):
    step = index + 1
    state, step_metrics = train_fn(
        state, put_batch(experiment, loader.batch(index))
    )
    if on_cpu:
      # XLA:CPU's simulated devices can deadlock in a collective's
      # rendezvous with several steps in flight on few cores.
      jax.block_until_ready(state)
    if pending:
      record_step(*pending, time.perf_counter() - tick)
      tick = time.perf_counter()
    pending = (step, step_metrics)
    due_eval = _due(step, config.eval_every_steps, last)
    due_save = _due(step, config.checkpoint_every_steps, last)
    if due_eval or due_save:
      record_step(*pending, time.perf_counter() - tick)
      pending = None
      if due_eval:
        eval_metrics = evaluate(experiment, eval_fn, state)
        log.write({"step": step, **eval_metrics})
      if due_save:
        ckpt.save(
            step,
            state,
            {
                "step": step,
                "phase": step % len(cycle),
                "data": loader.position(step),
            },
        )
      tick = time.perf_counter()
  if pending:
    record_step(*pending, time.perf_counter() - tick)
  bar.close()
  ckpt.close()
  if not eval_metrics:
    eval_metrics = evaluate(experiment, eval_fn, state)
  # The first step of each phase compiles; the median skips them.
  steady = durations[len(cycle) :] or durations
  return {
      "step": int(state.step),
      "compressor": config.compressor.name,
      **metrics,
      **eval_metrics,
      "bytes_per_step": statistics.mean(bytes_per_step),
      "bytes_per_phase": bytes_per_step,
      "examples_per_sec": (
          experiment.global_batch / statistics.median(steady)
          if steady
          else None
      ),
      "num_devices": experiment.num_devices,
      "params_sha256": params_digest(state.params),
      "ignored_compressor_args": experiment.ignored_compressor_args,
  }


def format_summary(summary: dict[str, Any]) -> str:
  """A one-screen report of a finished run."""
  rows = [
      ("compressor", summary["compressor"]),
      ("devices", summary["num_devices"]),
      ("steps", summary["step"]),
  ]
  for key in ("loss", "accuracy", "eval_loss", "eval_accuracy"):
    if key in summary:
      rows.append((key, f"{summary[key]:.4f}"))
  phases = summary["bytes_per_phase"]
  rows.append(
      (
          "bytes/step/device",
          f"{summary['bytes_per_step']:,.0f}"
          + (
              f" (phases {', '.join(f'{b:,}' for b in phases)})"
              if len(phases) > 1
              else ""
          ),
      )
  )
  if summary["examples_per_sec"]:
    rows.append(("examples/s", f"{summary['examples_per_sec']:,.0f}"))
  rows.append(("params sha256", summary["params_sha256"]))
  if summary["ignored_compressor_args"]:
    rows.append(("ignored args", ", ".join(summary["ignored_compressor_args"])))
  return "\n".join(f"{k:>18}  {v}" for k, v in rows)


def format_comparison(summaries: list[dict[str, Any]]) -> str:
  """Runs side by side: held-out accuracy and loss, bytes, throughput."""
  lines = [
      f"{'compressor':<12}{'eval acc':>10}{'eval loss':>11}"
      f"{'bytes/step':>14}{'vs ssgd':>9}{'examples/s':>12}"
  ]
  dense = next(
      (s["bytes_per_step"] for s in summaries if s["compressor"] == "ssgd"),
      None,
  )
  for s in summaries:
    ratio = f"{dense / s['bytes_per_step']:.1f}x" if dense else "-"
    speed = s["examples_per_sec"]
    lines.append(
        f"{s['compressor']:<12}{s['eval_accuracy']:>10.4f}"
        f"{s['eval_loss']:>11.4f}{s['bytes_per_step']:>14,.0f}{ratio:>9}"
        f"{(f'{speed:,.0f}' if speed else '-'):>12}"
    )
  return "\n".join(lines)
