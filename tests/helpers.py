"""Running a compressor's update on the simulated devices; every compressor
and a small MLP to train; running the repository's commands, one process or several joined; a free
port."""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from acp_jax import checkpoint as acp_checkpoint
from tests.conftest import NUM_DEVICES

AXIS = "data"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every compressor, with settings that compress the small MLP.
COMPRESSORS = {
    "ssgd": acp_jax.ssgd,
    "sign_sgd": acp_jax.sign_sgd,
    "topk_sgd": lambda: acp_jax.topk_sgd(0.3),
    "power_sgd": lambda: acp_jax.power_sgd(2),
    "acp_sgd": lambda: acp_jax.acp_sgd(2),
}


def mesh():
  return jax.make_mesh(
      (NUM_DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
  )


def shard(tree):
  """Puts arrays stacked on a leading device axis one slice per device."""
  return jax.device_put(tree, NamedSharding(mesh(), P(AXIS)))


def replicate(tree, n=NUM_DEVICES):
  """One copy per device, stacked on a new leading axis and sharded."""
  return shard(
      jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)
  )


def _blocking(f):
  """``f`` that waits for its results.

  With several steps in flight, XLA:CPU's simulated devices can deadlock in a
  collective's rendezvous on 2 cores (jax 0.10.2: "Expected 8 threads to
  join the rendezvous, but only 6 of them arrived"), so tests run one step at
  a time.
  """

  def run(*args):
    return jax.block_until_ready(f(*args))

  run.lower = f.lower
  return run


def per_device(local):
  """``local`` on each device's slice of arrays stacked on a leading axis.

  Every input and output (state included: residuals differ across devices)
  carries a leading device axis, sharded over the mesh.
  """

  def body(*args):
    args = jax.tree.map(lambda x: x[0], args)
    return jax.tree.map(lambda x: x[None], local(*args))

  return _blocking(
      jax.jit(
          jax.shard_map(body, mesh=mesh(), in_specs=P(AXIS), out_specs=P(AXIS))
      )
  )


def per_device_state(local):
  """A user's own shard_map step ``local(params, state, *batch) -> (params,
  state, loss)``: params replicated, the state stacked one slice per device,
  the batch split along its leading axis, the loss replicated."""

  def body(params, state, *batch):
    params, state, loss = local(
        params, jax.tree.map(lambda x: x[0], state), *batch
    )
    return params, jax.tree.map(lambda x: x[None], state), loss

  return _blocking(
      jax.jit(
          jax.shard_map(
              body,
              mesh=mesh(),
              in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
              out_specs=(P(), P(AXIS), P()),
              check_vma=False,
          )
      )
  )


def mapped(update, mapper):
  """``update(grads, state)`` over stacked per-device inputs, by ``mapper``."""
  if mapper == "pmap":
    return _blocking(jax.pmap(update, axis_name=AXIS))
  assert mapper == "shard_map", mapper
  return per_device(update)


def random_grads(seed, params, n=NUM_DEVICES):
  """Different gradients on each device, stacked, in each leaf's dtype.

  Drawn by NumPy: jax.random compiles a program per shape, seconds each here.
  """
  rng = np.random.default_rng(seed)
  return shard(
      jax.tree.map(
          lambda x: rng.standard_normal((n,) + x.shape).astype(x.dtype), params
      )
  )


def mlp_problem(steps):
  """The small MLP's data and params, drawn from one seed: ``steps``
  batches of inputs (4 per device, 12 features) and of labels (5 classes),
  and params for ``mlp_loss``."""
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((steps, 4 * NUM_DEVICES, 12)).astype(np.float32)
  ys = rng.integers(0, 5, (steps, 4 * NUM_DEVICES))
  params = {
      "w1": rng.standard_normal((12, 32)).astype(np.float32) / 4,
      "b1": np.zeros(32, np.float32),
      "w2": rng.standard_normal((32, 5)).astype(np.float32) / 6,
  }
  return xs, ys, params


def mlp_loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(dp, tx, loss_fn):
  """The jitted step of ``tx`` (chained by ``dp``) on the gradients of
  ``loss_fn(params, x, y)``: ``(params, state, x, y) -> (params, state,
  loss)``."""

  @jax.jit
  def step(params, state, x, y):
    loss, grads = dp.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def run_steps(dp, params, steps, state=None, start=0):
  """``steps`` steps of ``dp.compress``, jitted, from step ``start`` on
  ``random_grads`` like ``params``, each after ``at_step``; from
  ``dp.init_comm(params)`` if ``state`` is None. Returns the directions, as
  numpy, and the last state."""
  compress = jax.jit(dp.compress)
  state = dp.init_comm(params) if state is None else state
  directions = []
  for step in range(start, start + steps):
    state = dp.compressor.at_step(state, step)
    direction, state = compress(random_grads(step, params), state)
    directions.append(to_numpy(direction))
  return directions, state


def assert_resume_is_bitwise(make_dp, params, directory, steps, stop):
  """``run_steps`` over ``steps`` steps gives, bit for bit, what its first
  ``stop`` steps, a checkpoint in ``directory`` restored into a fresh
  state, and the remaining steps give; ``make_dp()`` makes each run's
  ``DataParallel``."""
  whole, _ = run_steps(make_dp(), params, steps)
  first, state = run_steps(make_dp(), params, stop)
  dp = make_dp()
  acp_checkpoint.save(directory, state, compressor=dp.compressor)
  restored = acp_checkpoint.restore(
      directory, dp.init_comm(params), compressor=dp.compressor
  )
  rest, _ = run_steps(make_dp(), params, steps - stop, restored, stop)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(first + rest)):
    np.testing.assert_array_equal(a, b)


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


# A tree mixing every kind of leaf: a conv kernel and a dense kernel that are
# compressed, a matrix too small to compress, a bias and a scalar.
MIXED = {
    "conv": {"kernel": jnp.zeros((3, 3, 4, 8))},
    "dense": {"kernel": jnp.zeros((16, 12)), "bias": jnp.zeros((12,))},
    "tiny": jnp.zeros((2, 3)),
    "temperature": jnp.zeros(()),
}


# XLA:CPU's combiner merges every set of independent all-reduces into one;
# without it each all-reduce stays as the program issues it, as on a GPU
# below its combine threshold.
ONE_BY_ONE = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def compiled_update(tx, params, state=None, compiler_options=None):
  """The compiled exchange of ``tx`` for ``params`` (shapes suffice), in the
  layout of ``acp_jax.DataParallel``; ``state`` picks the phase."""
  dp = acp_jax.DataParallel(tx, mesh())
  if state is None:
    state = dp.abstract_comm(params)
  return (
      jax.jit(dp.compress)
      .lower(dp.abstract_local_grads(params), state)
      .compile(compiler_options)
  )


def phase_states(tx, params):
  """The abstract state before each phase's step, by phase name."""
  dp = acp_jax.DataParallel(tx, mesh())
  return dp.phase_states(dp.abstract_comm(params))


def finish(procs, timeout: float) -> list[tuple[str, str]]:
  """Each process's (stdout, stderr); all are killed if time runs out or one
  raises."""
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  return outputs


def run_module(
    module: str, *args: str, timeout: float
) -> subprocess.CompletedProcess:
  """``python -m module *args`` in the repository's root, its output
  captured as text."""
  return subprocess.run(
      [sys.executable, "-m", module, *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def launch(
    args: list[str],
    processes: int,
    *,
    stderr: int = subprocess.PIPE,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
  """``processes`` runs of ``python *args`` in the repository's root, joined
  by ``jax.distributed``: each is told a coordinator on a free port of
  127.0.0.1, their count and its id. Output is captured as text (stderr
  into stdout with ``stderr=subprocess.STDOUT``)."""
  address = f"127.0.0.1:{free_port()}"
  return [
      subprocess.Popen(
          [
              sys.executable,
              *args,
              f"--coordinator_address={address}",
              f"--num_processes={processes}",
              f"--process_id={i}",
          ],
          cwd=ROOT,
          stdout=subprocess.PIPE,
          stderr=stderr,
          text=True,
          env=env,
      )
      for i in range(processes)
  ]


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
