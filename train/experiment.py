"""The experiment a config describes: mesh, data, model, compressor, state.

Everything is built before the first compilation. The state lives on a 1-D
``data`` mesh: params replicated; the compressor's state in the layout of
``acp_jax.DataParallel`` (each device's residuals stacked on a leading device
axis, the rest once); BatchNorm statistics replicated when synchronized and
stacked one slice per device when local. Batches are stacked the same way,
``[devices, per_device_batch, ...]``.
"""

import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from train import config as config_lib
from train import data as data_lib
from train import models
from train import optimizers

AXIS = "data"
DEVICE = P(AXIS)  # stacked on a leading device axis, one slice per device
REPLICATED = P()
# Scalars all-reduced by every train step: loss, correct, weight, |grad|^2
# and the number of devices holding a non-finite array of the state.
NUM_REDUCED_METRICS = 5


class TrainState(NamedTuple):
  step: jax.Array  # int32 [], updates applied so far
  params: Any  # nested dict of float32 arrays, replicated
  batch_stats: Any  # BatchNorm running statistics (empty without BN)
  opt_state: acp_jax.DataParallelState  # compressor + optimizer state
  rng: jax.Array  # uint32 [2], base key for dropout


def batch_stats_spec(batch_norm: str) -> P:
  """Synced statistics agree across devices; local ones differ."""
  return REPLICATED if batch_norm == "sync" else DEVICE


def state_parts(
    state: TrainState, dp: acp_jax.DataParallel, batch_norm: str
) -> list[tuple[P, Any]]:
  """The state as ``(spec, subtree)`` pairs, each subtree laid out by its
  spec: stacked one slice per device (``DEVICE``) or replicated."""
  comm = state.opt_state.comm
  return [
      (REPLICATED, (state.step, state.params, state.rng)),
      (batch_stats_spec(batch_norm), state.batch_stats),
      (REPLICATED, state.opt_state.inner),
      *zip(dp.comm_specs(comm), comm),
  ]


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
  return 4 * acp_jax.collectives.dense_nbytes(means)


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
  dp: acp_jax.DataParallel
  tx: optax.GradientTransformation  # dp.chain(the base optimizer)
  schedule: optax.Schedule
  global_batch: int

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  def bytes_per_phase(self) -> dict[str, int]:
    """Bytes each device sends in a step of each phase, by the phase names
    of ``acp_jax.comm_bytes`` (a warm-up's ``"dense"`` included)."""
    volumes = acp_jax.comm_bytes(
        self.compressor, self.abstract_params, num_devices=self.num_devices
    )
    overhead = 4 * NUM_REDUCED_METRICS + sync_batch_norm_bytes(
        self.abstract_batch_stats, self.config.batch_norm
    )
    return {name: v.total + overhead for name, v in volumes.items()}

  def bytes_per_step(self) -> list[int]:
    """Bytes each device sends per step, for each step of the compressing
    phase cycle (after any warm-up)."""
    by_phase = self.bytes_per_phase()
    return [by_phase[name] for name in self.compressor.cycle]

  def bytes_through(self, steps: int) -> int:
    """Bytes each device sends in the first ``steps`` steps."""
    by_phase = self.bytes_per_phase()
    dense = min(steps, self.compressor.warmup_steps)
    cycle = self.bytes_per_step()
    full, part = divmod(steps - dense, len(cycle))
    warmup = by_phase.get(acp_jax.phase.DENSE, 0)
    return dense * warmup + full * sum(cycle) + sum(cycle[:part])


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


def _backward_order(config, dataset, model_kwargs, split) -> tuple[int, ...]:
  """The order in which backprop computes the model's gradients
  (``acp_jax.backward_order``), read from a train-mode forward pass on one
  example's shapes, for the compressor's buckets.

  ``split`` is the abstract model's (graphdef, params, batch_stats). With
  synchronized BatchNorm, which needs its mapped axis, the order is read
  from a model with local statistics: the same params, the same backprop.
  """
  if config.batch_norm == "sync":
    split = nnx.split(
        nnx.eval_shape(
            lambda: models.create(
                config.model.name,
                rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")),
                **model_kwargs,
            )
        ),
        nnx.Param,
        nnx.BatchStat,
    )
  graphdef, params, batch_stats = split
  example = dataset.train.get(np.arange(1))["inputs"]
  inputs = jax.ShapeDtypeStruct(example.shape, example.dtype)

  def loss(params, batch_stats, inputs):
    model = nnx.merge(graphdef, params, batch_stats)
    outputs = model(inputs, train=True, rngs=nnx.Rngs(dropout=0))
    return jnp.sum(outputs.astype(jnp.float32))

  return acp_jax.backward_order(
      loss, nnx.to_pure_dict(params), nnx.to_pure_dict(batch_stats), inputs
  )


# Bytes per row that the loader adds to a batch's own: int64 positions,
# epochs, offsets, indices and three seeds.
_LOADER_BYTES_PER_ROW = 7 * 8


def _check_batch_fits(config, dataset, global_batch: int) -> None:
  """Raises ``ValueError`` naming the batch size's key if one batch of this
  process's rows would not fit in this machine's memory."""
  example = dataset.train.get(np.arange(1))
  per_row = _LOADER_BYTES_PER_ROW + sum(x.nbytes for x in example.values())
  need = global_batch // jax.process_count() * per_row
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if need <= memory:
    return
  key = "batch_size" if config.batch_size else "per_device_batch_size"
  raise ValueError(
      f"config.{key}={config[key]} needs {need / 2**30:.1f} GiB of host"
      f" memory for one batch of {global_batch} examples ({per_row} bytes"
      f" each), more than this machine's {memory / 2**30:.1f} GiB; lower"
      f" config.{key} (the training set holds {len(dataset.train)} examples)"
  )


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Checks ``config`` and builds everything but the compiled steps."""
  num_devices = jax.device_count()
  config_lib.validate(config, num_devices)
  global_batch = config_lib.global_batch_size(config, num_devices)
  dataset = data_lib.build(config.data)
  _check_batch_fits(config, dataset, global_batch)
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
  compressor = optimizers.compressor(
      config,
      AXIS,
      leaf_order=_backward_order(
          config, dataset, model_kwargs, (graphdef, params, batch_stats)
      ),
  )
  schedule = optimizers.schedule(config)
  mesh = jax.make_mesh(
      (num_devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
  )
  dp = acp_jax.DataParallel(compressor, mesh)
  return Experiment(
      config=config,
      mesh=mesh,
      dataset=dataset,
      create_model=create,
      graphdef=graphdef,
      abstract_params=nnx.to_pure_dict(params),
      abstract_batch_stats=nnx.to_pure_dict(batch_stats),
      compressor=compressor,
      dp=dp,
      tx=dp.chain(optimizers.optimizer(config, schedule)),
      schedule=schedule,
      global_batch=global_batch,
  )


def init_state(experiment: Experiment) -> TrainState:
  """The initial state, made on the devices in the mesh layout."""
  config, mesh = experiment.config, experiment.mesh
  replicated = NamedSharding(mesh, REPLICATED)
  stats_spec = batch_stats_spec(config.batch_norm)
  n = experiment.num_devices

  @functools.partial(
      jax.jit, out_shardings=(replicated, NamedSharding(mesh, stats_spec))
  )
  def init_model():
    _, params, batch_stats = nnx.split(
        experiment.create_model(), nnx.Param, nnx.BatchStat
    )
    batch_stats = nnx.to_pure_dict(batch_stats)
    if stats_spec == DEVICE:
      batch_stats = jax.tree.map(
          lambda x: jnp.broadcast_to(x, (n,) + x.shape), batch_stats
      )
    return nnx.to_pure_dict(params), batch_stats

  params, batch_stats = init_model()
  return TrainState(
      step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
      params=params,
      batch_stats=batch_stats,
      opt_state=experiment.tx.init(params),
      rng=jax.device_put(jax.random.PRNGKey(config.seed), replicated),
  )


def abstract_phase_states(experiment: Experiment) -> dict[str, TrainState]:
  """Shapes and shardings of the state before each phase's step, by the
  phase names of ``acp_jax.comm_bytes``."""
  state = jax.eval_shape(lambda: init_state(experiment))
  return {
      name: state._replace(opt_state=state.opt_state._replace(comm=comm))
      for name, comm in experiment.dp.phase_states(
          state.opt_state.comm
      ).items()
  }


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


