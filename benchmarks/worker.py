"""One JAX process of the cluster benchmark; ``benchmarks/cluster.py`` starts
N of them, one per network namespace, and reads the ``RESULT`` line each
prints.

  python -m benchmarks.worker parts --workload W --compressor C --steps S \
      [--warmup W] [--breakdown] \
      --coordinator_address A --num_processes N --process_id I
  python -m benchmarks.worker quality --task T --variant V --seed S \
      --data_path F --workdir D --steps S --eval_every E [--target L] \
      --coordinator_address A --num_processes N --process_id I
  python -m benchmarks.worker overlap --workload W --compressor C \
      --steps S --rounds R --coordinator_address A --num_processes N \
      --process_id I
  python -m benchmarks.worker psum --sizes 4096,1048576 --repeats 5 \
      [--busy_mb MB] --coordinator_address A --num_processes N --process_id I
  python -m benchmarks.worker nodes --workload W --compressor C --steps S \
      --devices D [--layout L] [--link eth0] [--params_out F.npz] \
      --coordinator_address A --num_processes N --process_id I

``parts`` times a data-parallel step, the same step on each process's
device alone (the compute-only step the cost model starts from) and, with
``--breakdown``, the step's parts, all in lockstep. ``overlap`` times the workload's step fused
and overlapped (``acp_jax.DataParallel.step`` on the model's stages),
alternating round by round, and the fused step on this process's device
alone. ``quality`` trains a convergence task with
the trainer until its held-out loss reaches a target (time to quality on
the link). ``psum`` times
all-reduces of float32 buffers of the given byte sizes, on idle processes
and right after a pass over memory, for calibrating the cost model on the
links. ``nodes`` trains on ``D`` devices
per process, each process a node of a (processes x D) mesh, in one of
``LAYOUTS``: flat (the compressor over all devices),
hierarchical (a dense mean within the process, the compressor across
processes) or sharded (hierarchical with the params and the optimizer's and
compressor's state sharded over the process's devices); with ``--link``, it
counts the bytes that interface (its namespace's link to the switch) sent
and received, and the packets it sent, per timed step; with
``--params_out``, it saves the params before and after the steps, whole,
for comparing runs.

The modes are one program, kept in one module: they share the
process's start (``jax.distributed``, in ``main``), its flags, and ``parts``
and ``nodes`` the workload's data-parallel step (``_data_parallel``).
"""

import argparse
import functools
import json
import pathlib
import resource
import statistics
import time

_DIST = ("coordinator_address", "num_processes", "process_id")
# How ``nodes`` lays out the mesh and the model (``_mesh_and_dp``).
LAYOUTS = ("flat", "hierarchical", "sharded")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
  sub = parser.add_subparsers(dest="mode", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--coordinator_address")
  common.add_argument("--num_processes", type=int)
  common.add_argument("--process_id", type=int)
  nodes = sub.add_parser("nodes", parents=[common])
  nodes.add_argument("--workload", required=True)
  nodes.add_argument("--compressor", required=True)
  nodes.add_argument("--steps", type=int, required=True)
  nodes.add_argument("--devices", type=int, required=True, help="per process")
  nodes.add_argument("--layout", choices=LAYOUTS, default="flat")
  nodes.add_argument(
      "--link", help="network interface whose bytes to count, e.g. eth0"
  )
  nodes.add_argument(
      "--params_out",
      help="an .npz file for the params before and after the steps",
  )
  quality = sub.add_parser("quality", parents=[common])
  quality.add_argument("--task", required=True)
  quality.add_argument("--variant", required=True)
  quality.add_argument("--seed", type=int, default=0)
  quality.add_argument("--data_path", required=True)
  quality.add_argument("--workdir", required=True)
  quality.add_argument("--steps", type=int, required=True, help="the cap")
  quality.add_argument("--eval_every", type=int, required=True)
  quality.add_argument(
      "--target", type=float, help="held-out loss to stop at (none: the cap)"
  )
  quality.add_argument("--quick", action="store_true")
  parts = sub.add_parser("parts", parents=[common])
  parts.add_argument("--workload", required=True)
  parts.add_argument("--compressor", required=True)
  parts.add_argument("--steps", type=int, required=True)
  parts.add_argument(
      "--warmup",
      type=int,
      default=0,
      help="untimed steps at the start of each round (the first round: at"
      " least two of each phase, which compile)",
  )
  parts.add_argument(
      "--breakdown",
      action=argparse.BooleanOptionalAction,
      default=False,
      help="then one more round that also times the step's parts",
  )
  overlap = sub.add_parser("overlap", parents=[common])
  overlap.add_argument("--workload", required=True)
  overlap.add_argument("--compressor", required=True)
  overlap.add_argument("--steps", type=int, required=True, help="per round")
  overlap.add_argument("--rounds", type=int, default=3)
  overlap.add_argument("--warmup", type=int, default=4)
  psum = sub.add_parser("psum", parents=[common])
  psum.add_argument("--sizes", required=True, help="comma-separated bytes")
  psum.add_argument("--repeats", type=int, default=5)
  psum.add_argument(
      "--busy_mb",
      type=float,
      default=0.0,
      help="also time each all-reduce right after a pass over this many MB",
  )
  return parser


# The counters of a link that ``nodes`` reads, per timed step.
LINK_COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets")


def _link_counters(interface: str | None) -> list[int] | None:
  """``LINK_COUNTERS`` of ``interface`` so far, or None."""
  if interface is None:
    return None
  stats = pathlib.Path("/sys/class/net", interface, "statistics")
  return [int((stats / f).read_text()) for f in LINK_COUNTERS]


def _mesh_and_dp(compressor, layout: str):
  """The ``DataParallel`` of ``layout`` over every process's devices:
  ``flat``, one mesh axis over all devices; ``hierarchical``, a row of the
  mesh per process, the compressor across rows; ``sharded``, as
  hierarchical with the model sharded within each row."""
  import jax
  import numpy as np

  import acp_jax

  # Devices in process order: a flat ring over them crosses between
  # processes as rarely as a ring can, and a row is one process's.
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if layout == "flat":
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    return acp_jax.DataParallel(compressor, mesh)
  mesh = jax.sharding.Mesh(
      np.array(devices).reshape(jax.process_count(), -1), ("data", "local")
  )
  make = {
      "hierarchical": acp_jax.DataParallel,
      "sharded": acp_jax.ShardedDataParallel,
  }[layout]
  return make(compressor, mesh, local_axis="local")


def _global_batch(experiment, dp):
  """The workload's first global batch, stacked [devices, per_device, ...]
  and sharded over the devices; each process puts its own devices' rows.
  Every step takes it."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding

  rows = experiment.dataset.train.get(np.arange(experiment.global_batch))
  stacked = {
      k: v.reshape((dp.num_devices, -1) + v.shape[1:]) for k, v in rows.items()
  }
  return {
      k: jax.make_array_from_callback(
          v.shape,
          NamedSharding(dp.mesh, dp.device_spec),
          lambda index, v=v: v[index],
      )
      for k, v in stacked.items()
  }


def _loss_fn(experiment):
  """The per-device loss of the workload's model on pure-dict params."""
  import jax
  from flax import nnx

  from train import loss as loss_lib

  graphdef, batch_stats = experiment.graphdef, experiment.abstract_batch_stats

  def loss_fn(params, batch):
    batch = jax.tree.map(lambda x: x[0], batch)
    model = nnx.merge(graphdef, params, batch_stats)
    logits = model(
        batch["inputs"], train=True, rngs=nnx.Rngs(dropout=jax.random.key(0))
    )
    return loss_lib.mean_loss(logits, batch)

  return loss_fn


def _data_parallel(args, layout: str):
  """The workload's data-parallel pieces on this run's devices: the
  ``DataParallel`` of ``layout``, the base optimizer, the params where it
  places them, the same global batch for every step, and the per-device
  loss."""
  import jax
  from flax import nnx

  from benchmarks import workloads
  from train import optimizers
  from train import experiment as experiment_lib

  config = workloads.cluster_config(args.workload, args.compressor, args.steps)
  # The model, data and optimizer of the workload; its 1-D mesh goes unused.
  experiment = experiment_lib.build(config)
  dp = _mesh_and_dp(experiment.compressor, layout)

  def init():
    model = experiment.create_model()
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])

  params = jax.jit(
      init, out_shardings=dp.param_shardings(jax.eval_shape(init))
  )()
  inner = optimizers.optimizer(config, experiment.schedule)
  batch = _global_batch(experiment, dp)
  return experiment, dp, inner, params, batch, _loss_fn(experiment)


def _step_fn(dp, tx, loss_fn):
  """The jitted data-parallel step: local gradients, their compressed mean
  fed to ``tx`` (a ``dp.chain``), the update applied. The batch is said to
  split on axis 0: a small workload's rows, one per device, could as well
  be time steps."""
  import jax
  import optax

  @jax.jit
  def step(params, state, batch):
    loss, grads = dp.value_and_grad(loss_fn, batch_specs=(dp.device_spec,))(
        params, batch
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def step_traffic(step, dp, params, state, batch) -> list[dict[str, int]]:
  """What each phase of ``step`` sends, from its compiled HLO: all-reduce
  and all-gather bytes (each device's buffers) and collective counts, as
  ``costmodel.Traffic``'s fields."""
  from acp_jax_tools import hlo

  phases = []
  for comm in dp.phase_states(state.comm).values():
    traffic = hlo.traffic(
        step.lower(params, state._replace(comm=comm), batch).compile()
    )
    other = {
        kind: stats
        for kind, stats in traffic.items()
        if stats.count and kind not in ("all-reduce", "all-gather")
    }
    if other:
      raise ValueError(f"unmodelled collectives in the step: {other}")
    phases.append(
        {
            "all_reduce": traffic["all-reduce"].bytes,
            "all_reduce_ops": traffic["all-reduce"].count,
            "all_gather": traffic["all-gather"].bytes,
            "all_gather_ops": traffic["all-gather"].count,
        }
    )
  return phases


def _whole(params) -> dict:
  """Each leaf of ``params`` whole, as numpy, by its path, from this
  process's shards (a node's process holds every slice of its params)."""
  import jax
  import numpy as np

  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    whole = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
      whole[shard.index] = np.asarray(shard.data)
    out[jax.tree_util.keystr(path, simple=True, separator="/")] = whole
  return out


def _timed_steps(step, params, state, batch, steps: int, link: str | None):
  """Runs ``steps`` steps after two that compile each phase's program;
  returns the last params, state and loss, each timed step's seconds and
  how much ``LINK_COUNTERS`` of ``link`` grew over the timed steps."""
  import jax

  for _ in range(2):
    params, state, loss = jax.block_until_ready(step(params, state, batch))
  before, times = _link_counters(link), []
  for _ in range(steps):
    start = time.perf_counter()
    params, state, loss = jax.block_until_ready(step(params, state, batch))
    times.append(time.perf_counter() - start)
  after = _link_counters(link)
  sent = None if before is None else [a - b for a, b in zip(after, before)]
  return params, state, loss, times, sent


def _nodes(args) -> dict:
  import numpy as np

  from train import metrics as metrics_lib

  experiment, dp, inner, params, batch, loss_fn = _data_parallel(
      args, args.layout
  )
  tx = dp.chain(inner)
  initial = _whole(params) if args.params_out else None
  params, _, loss, times, sent = _timed_steps(
      _step_fn(dp, tx, loss_fn),
      params,
      tx.init(params),
      batch,
      args.steps,
      args.link,
  )
  if args.params_out:
    final = _whole(params)
    np.savez(
        args.params_out,
        **{f"initial/{k}": v for k, v in initial.items()},
        **{f"final/{k}": v for k, v in final.items()},
    )
  per_axis = {
      axis: statistics.mean(v.total for v in phases.values())
      for axis, phases in dp.comm_bytes(experiment.abstract_params).items()
  }
  result = {
      "examples_per_sec": experiment.global_batch / statistics.median(times),
      "loss": float(loss),
      "params_sha256": metrics_lib.params_digest(params),
      "node_axis_bytes_per_device": per_axis["data"],
      "local_axis_bytes_per_device": per_axis.get("local", 0),
  }
  for name, grown in zip(LINK_COUNTERS, sent or ()):
    result[f"link_{name}_per_step"] = grown / args.steps
  return result


# What ``parts`` times with ``--breakdown``, each a median over the steps:
# the step's parts in order, and the compressor's arithmetic alone.
BREAKDOWN = ("forward_backward", "compress", "optimizer", "compress_local")
# ... and always: the fused step, the time its call takes to return, and the
# fused step on this process's device alone.
TIMES = BREAKDOWN + ("step", "dispatch", "step_local")


def _lockstep(mesh):
  """``timed(f, *xs)``: ``f(*xs)``, the seconds its call took to return and
  to finish; it starts after a barrier (an all-reduce of one float over
  ``mesh``), so that every process starts it together and its time is its
  own, not the wait for a slower process."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  one = jax.device_put(jnp.ones(()), NamedSharding(mesh, P()))
  barrier = jax.jit(
      jax.shard_map(
          lambda x: jax.lax.psum(x, mesh.axis_names),
          mesh=mesh,
          in_specs=P(),
          out_specs=P(),
          check_vma=False,
      )
  )

  def timed(f, *xs):
    jax.block_until_ready(barrier(one))
    start = time.perf_counter()
    out = f(*xs)
    returned = time.perf_counter()
    jax.block_until_ready(out)
    return out, returned - start, time.perf_counter() - start

  return timed


# What ``parts`` records of each fused step besides its seconds: this
# process's CPU seconds in user and kernel mode, and the pages it faulted.
USAGE = ("utime", "stime", "minflt")


def _usage() -> dict[str, float]:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return {"utime": r.ru_utime, "stime": r.ru_stime, "minflt": r.ru_minflt}


def _one_device(dp):
  """``dp``'s compressor on a mesh of this process's first device, where
  its collectives move nothing; and ``to_local(tree, spec)``, which puts
  this process's first shard of each leaf of ``tree`` there."""
  import jax
  from jax.sharding import NamedSharding

  import acp_jax

  local = acp_jax.DataParallel(
      dp.compressor,
      jax.sharding.Mesh(jax.local_devices()[:1], dp.mesh.axis_names),
  )

  def to_local(tree, spec):
    return jax.device_put(
        jax.tree.map(lambda x: x.addressable_data(0), tree),
        NamedSharding(local.mesh, spec),
    )

  return local, to_local


def _compress_fn(dp, params):
  """``dp.compress`` jitted with its state donated and the shardings of its
  results given: without them XLA pairs the donated residual with the
  first output of its size, the mean, and copies the residual first."""
  import jax

  return jax.jit(
      dp.compress,
      donate_argnums=(1,),
      out_shardings=dp.compress_shardings(params),
  )


def _part_programs(dp, local, inner, loss_fn, params) -> dict:
  """Each part of ``parts``'s step as its own jitted program, and the fused
  step on ``dp``'s devices (``step``) and on ``local``'s (``step_local``)."""
  import jax
  import optax

  @jax.jit
  def optimizer(mean, inner_state, params):
    updates, inner_state = inner.update(mean, inner_state, params)
    return optax.apply_updates(params, updates), inner_state

  return {
      "forward_backward": jax.jit(
          dp.value_and_grad(loss_fn, batch_specs=(dp.device_spec,))
      ),
      "compress": _compress_fn(dp, params),
      "compress_local": _compress_fn(local, params),
      "optimizer": optimizer,
      "step": _step_fn(dp, dp.chain(inner), loss_fn),
      "step_local": _step_fn(local, local.chain(inner), loss_fn),
  }


class _Timed:
  """One compressor's step on the cluster, timed a round at a time.

  Each round runs ``warmup`` untimed steps and then ``steps`` timed ones,
  every process at once (``_lockstep``). The whole step runs fused, as a
  user's loop runs it; ``dispatch`` is the time its call takes to return,
  before the host waits for the result. ``step_local`` is that fused step
  on this process's device alone: the compute-only step, taken in lockstep
  with the other processes, so that the cores are shared as in the cluster
  step. With ``breakdown`` a round also times the step's parts, each its
  own jitted program run on the output of the one before; the compressor's
  arithmetic alone (``compress_local``) runs the same compressor on this
  process's device alone (``_one_device``). The state carries over from
  round to round, as training goes on.
  """

  def __init__(self, args):
    from jax.sharding import PartitionSpec as P

    experiment, dp, inner, params, self.batch, loss_fn = _data_parallel(
        args, "flat"
    )
    self.dp, self.cycle = dp, len(experiment.compressor.cycle)
    local, self.to_local = _one_device(dp)
    self.local = local
    self.run = _part_programs(dp, local, inner, loss_fn, params)
    self.timed = _lockstep(dp.mesh)
    self.params, self.state = params, dp.chain(inner).init(params)
    self.local_batch = self.to_local(self.batch, local.device_spec)
    self.local_params = self.to_local(params, P())
    self.local_state = local.chain(inner).init(self.local_params)
    # The breakdown's own chain of state: parts in order, as one step.
    self.carry = {
        "params": params,
        "inner": self.state.inner,
        "comm": dp.init_comm(params),
        "comm_local": local.init_comm(params),
    }
    self.steps_run = 0

  def _parts(self, t: dict[str, float]) -> None:
    """One step taken apart, each part timed into ``t``."""
    import jax

    run, carry, timed = self.run, self.carry, self.timed
    (_, grads), _, t["forward_backward"] = timed(
        run["forward_backward"], carry["params"], self.batch
    )
    # The copy to the lone device is asynchronous: finished before the
    # clock starts, it is not counted as the compressor's arithmetic.
    local_grads = jax.block_until_ready(
        self.to_local(grads.stacked, self.local.device_spec)
    )
    (_, carry["comm_local"]), _, t["compress_local"] = timed(
        run["compress_local"], local_grads, carry["comm_local"]
    )
    (mean, carry["comm"]), _, t["compress"] = timed(
        run["compress"], grads.stacked, carry["comm"]
    )
    (carry["params"], carry["inner"]), _, t["optimizer"] = timed(
        run["optimizer"], mean, carry["inner"], carry["params"]
    )

  def round(self, warmup: int, steps: int, breakdown: bool) -> dict:
    """A round's median seconds of each of ``TIMES`` it timed, and a trace
    of each timed step: its phase, seconds and ``USAGE``."""
    times, trace = {}, []
    # The first round compiles each phase's programs in its first cycles.
    if not self.steps_run:
      warmup = max(warmup, 2 * self.cycle)
    for i in range(warmup + steps):
      t = {}
      if breakdown:
        self._parts(t)
      phase = self.steps_run % self.cycle
      before = _usage()
      (self.params, self.state, self.loss), t["dispatch"], t["step"] = (
          self.timed(self.run["step"], self.params, self.state, self.batch)
      )
      after = _usage()
      (self.local_params, self.local_state, _), _, t["step_local"] = (
          self.timed(
              self.run["step_local"],
              self.local_params,
              self.local_state,
              self.local_batch,
          )
      )
      self.steps_run += 1
      if i < warmup:
        continue
      for key, value in t.items():
        times.setdefault(key, []).append(value)
      trace.append(
          {
              "phase": phase,
              "step_s": t["step"],
              "step_local_s": t["step_local"],
              **{k: after[k] - before[k] for k in USAGE},
          }
      )
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "trace": trace,
    }

  def summary(self) -> dict:
    from train import metrics as metrics_lib

    return {
        "traffic": step_traffic(
            self.run["step"], self.dp, self.params, self.state, self.batch
        ),
        "loss": float(self.loss),
        "params_sha256": metrics_lib.params_digest(self.params),
    }


def _parts(args) -> dict:
  """Times the step of ``--compressor`` (``_Timed``): a round, and with
  ``--breakdown`` one more that also takes the step apart."""
  method = _Timed(args)
  out = {"rounds": [method.round(args.warmup, args.steps, False)]}
  if args.breakdown:
    out["breakdown"] = method.round(args.warmup, args.steps, True)["seconds"]
  return {**out, **method.summary()}


def model_blocks(experiment) -> list:
  """The workload's per-device loss as the blocks of
  ``DataParallel.step``: each of its model's ``stages``, the last followed
  by the loss, on pure-dict params and the stacked batch of ``_loss_fn``."""
  import jax
  from flax import nnx

  from train import loss as loss_lib

  graphdef, batch_stats = experiment.graphdef, experiment.abstract_batch_stats
  num = len(
      nnx.merge(graphdef, experiment.abstract_params, batch_stats).stages(
          train=False
      )
  )

  def block(k, params, carry, batch):
    batch = jax.tree.map(lambda x: x[0], batch)
    model = nnx.merge(graphdef, params, batch_stats)
    rngs = nnx.Rngs(dropout=jax.random.key(k))
    stage = model.stages(train=True, rngs=rngs)[k]
    out = stage(batch["inputs"] if carry is None else carry)
    return loss_lib.mean_loss(out, batch) if k == num - 1 else out

  return [functools.partial(block, k) for k in range(num)]


# The steps ``overlap`` times, alternating round by round.
OVERLAP_MODES = ("fused", "overlapped")


def _overlap(args) -> dict:
  """Each round's median seconds of the step fused and overlapped, in
  lockstep (``_lockstep``), the two alternating which goes first; and of
  the fused step on this process's device alone, the compute-only step."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  experiment, dp, inner, params, batch, _ = _data_parallel(args, "flat")
  blocks = model_blocks(experiment)
  local, to_local = _one_device(dp)
  runs = {
      mode: {
          "step": dp.step(inner, blocks, overlap=mode == "overlapped"),
          "params": jax.tree.map(jnp.copy, params),
          "batch": batch,
      }
      for mode in OVERLAP_MODES
  }
  runs["local"] = {
      "step": local.step(inner, blocks, overlap=False),
      "params": to_local(params, P()),
      "batch": to_local(batch, local.device_spec),
  }
  for mode, run in runs.items():
    owner = local if mode == "local" else dp
    run["state"] = owner.chain(inner).init(run["params"])
    run["steps"] = 0
  timed, cycle = _lockstep(dp.mesh), len(experiment.compressor.cycle)

  def steps(run, n):
    seconds = []
    for _ in range(n):
      owner = local if run is runs["local"] else dp
      state = owner.at_step(run["state"], run["steps"])
      (run["params"], run["state"], loss), _, t = timed(
          run["step"], run["params"], state, run["batch"]
      )
      run["steps"] += 1
      seconds.append(t)
    return seconds, float(loss)

  rounds = []
  for r in range(args.rounds):
    order = OVERLAP_MODES if r % 2 == 0 else OVERLAP_MODES[::-1]
    medians = {}
    for mode in (*order, "local"):
      warmup = max(args.warmup, 2 * cycle) if r == 0 else args.warmup
      steps(runs[mode], warmup)
      seconds, loss = steps(runs[mode], args.steps)
      medians[mode] = statistics.median(seconds)
      medians[f"{mode}_loss"] = loss
    rounds.append(medians)
  return {
      "rounds": rounds,
      "exchange_order": list(runs["overlapped"]["step"].exchange_order),
  }


def psum(args) -> dict:
  """Median seconds of an all-reduce of each size: on idle processes
  (``psum_seconds``), and, with ``--busy_mb``, right after every process
  computed a pass over that many megabytes (``busy_psum_seconds``: the
  all-reduce's share of compute-then-all-reduce, as inside a train step)."""
  import jax
  from jax import lax
  import jax.numpy as jnp
  import numpy as np

  sizes = [int(s) for s in args.sizes.split(",")]
  n = len(jax.local_devices())
  allreduce = jax.pmap(lambda x: lax.psum(x, "i"), axis_name="i")
  barrier = np.ones((n, 1), np.float32)
  work = np.ones((n, int(args.busy_mb * 1e6) // 4), np.float32)

  def compute(w, x):
    return x.at[0].add(jnp.sum(jnp.sin(w)))

  busy = jax.pmap(compute)
  busy_then_reduce = jax.pmap(
      lambda w, x: lax.psum(compute(w, x), "i"), axis_name="i"
  )

  def median_seconds(f, *xs):
    f(*xs).block_until_ready()  # compiles, connects
    times = []
    for _ in range(args.repeats):
      allreduce(barrier).block_until_ready()  # every process starts at once
      start = time.perf_counter()
      f(*xs).block_until_ready()
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  result = {"psum_seconds": {}, "busy_psum_seconds": {}}
  for size in sizes:
    x = np.ones((n, size // 4), np.float32)
    result["psum_seconds"][str(size)] = median_seconds(allreduce, x)
    if args.busy_mb:
      result["busy_psum_seconds"][str(size)] = median_seconds(
          busy_then_reduce, work, x
      ) - median_seconds(busy, work, x)
  return result


def quality(args) -> dict:
  """Trains a convergence task's variant with the trainer, this process one
  worker of the cluster, until its held-out loss reaches ``--target`` or
  ``--steps`` pass; the summary and, on process 0 (which writes the log),
  the held-out curve against the training seconds."""
  from benchmarks import convergence
  from train import metrics as metrics_lib
  from train import train

  cfg = convergence.config(
      args.task, args.variant, args.data_path, args.quick, args.seed
  )
  cfg.num_train_steps = args.steps
  cfg.eval_every_steps = args.eval_every
  cfg.target_eval_loss = args.target
  start = time.perf_counter()
  summary = train.train_and_evaluate(cfg, args.workdir)
  lines = metrics_lib.read_curves(args.workdir) if args.process_id == 0 else []
  curve = [
      {k: line[k] for k in ("step", "eval_loss", "train_seconds")}
      for line in lines
      if "eval_loss" in line
  ]
  return {
      "wall_seconds": time.perf_counter() - start,
      "global_batch": cfg.batch_size,
      "summary": {k: summary.get(k) for k in QUALITY_SUMMARY},
      "curve": curve,
  }


# What a quality run reports of the trainer's summary.
QUALITY_SUMMARY = (
    "step",
    "target_step",
    "eval_loss",
    "train_seconds",
    "bytes_per_step",
    "bytes_sent",
    "examples_per_sec",
    "num_devices",
)


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  from train import runtime

  devices = args.devices if args.mode == "nodes" else 1
  runtime.setup(num_cpu_devices=devices, **{k: getattr(args, k) for k in _DIST})
  modes = {
      "nodes": _nodes,
      "parts": _parts,
      "overlap": _overlap,
      "psum": psum,
      "quality": quality,
  }
  result = modes[args.mode](args)
  print("RESULT " + json.dumps({"process_id": args.process_id, **result}))


if __name__ == "__main__":
  main()
