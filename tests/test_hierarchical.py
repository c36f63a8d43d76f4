"""Hierarchical DataParallel: a dense mean within a node, compression across.

Eight simulated devices as 2 nodes x 4 devices per node; the node axis is
the compressor's ("data"), the local one "local".
"""

import os
import re
import subprocess
import sys

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from tests import helpers
from tests.conftest import NUM_DEVICES

NODES, LOCAL = 2, NUM_DEVICES // 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(0)
X = RNG.standard_normal((4 * NUM_DEVICES, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 4 * NUM_DEVICES)
PARAMS = {
    "w1": RNG.standard_normal((12, 32)).astype(np.float32) / 4,
    "b1": np.zeros(32, np.float32),
    "w2": RNG.standard_normal((32, 5)).astype(np.float32) / 6,
}
# No all-reduce is merged with another, so each one's group says its axis.
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def mlp_loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def mesh2d():
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh(
      (NODES, LOCAL), ("data", "local"), axis_types=(auto, auto)
  )


def hierarchical(compressor):
  return acp_jax.DataParallel(compressor, mesh2d(), local_axis="local")


def make_step(dp, tx):
  @jax.jit
  def step(params, state, x, y):
    loss, grads = dp.value_and_grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def train(dp, steps, lr=0.1):
  tx = dp.chain(optax.sgd(lr, momentum=0.9))
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  state = tx.init(params)
  x, y = jax.device_put((X, Y), NamedSharding(dp.mesh, dp.device_spec))
  step = make_step(dp, tx)
  losses = []
  for _ in range(steps):
    params, state, loss = jax.block_until_ready(step(params, state, x, y))
    losses.append(float(loss))
  return params, state, losses


def test_hierarchical_ssgd_trains_like_flat_ssgd_over_all_devices():
  flat = acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh())
  params_h, _, losses_h = train(hierarchical(acp_jax.ssgd()), 5)
  params_f, _, losses_f = train(flat, 5)
  np.testing.assert_allclose(losses_h, losses_f, rtol=1e-6)
  chex.assert_trees_all_close(params_h, params_f, rtol=1e-5, atol=1e-6)


def test_hierarchical_mean_gradient_is_the_mean_over_all_devices():
  dp = hierarchical(acp_jax.ssgd())
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  x, y = jax.device_put((X, Y), NamedSharding(dp.mesh, dp.device_spec))
  _, grads = jax.jit(dp.value_and_grad(mlp_loss))(params, x, y)
  for g in jax.tree.leaves(grads):
    assert g.shape[0] == NUM_DEVICES
    assert g.sharding.spec == P(("data", "local"))
  mean, _ = jax.jit(dp.compress)(grads, dp.init_comm(params))
  chex.assert_trees_all_close(
      mean, jax.grad(mlp_loss)(PARAMS, X, Y), rtol=1e-5, atol=1e-7
  )


def _groups(attribute: str) -> frozenset[tuple[int, ...]]:
  """The groups of an HLO ``replica_groups={{0,1},{2,3}}`` value."""
  return frozenset(
      tuple(int(i) for i in g.split(","))
      for g in re.findall(r"\{([0-9,]+)\}", attribute)
  )


def all_reduce_bytes_by_axis(hlo_text: str, mesh) -> dict[str, int]:
  """All-reduce result bytes per device, by the mesh axes each all-reduce
  runs over (read from its replica groups: positions in the mesh)."""
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  axes_of = {
      frozenset(tuple(row) for row in ids.tolist()): "local",
      frozenset(tuple(col) for col in ids.T.tolist()): "data",
      frozenset([tuple(ids.ravel().tolist())]): "all",
  }
  totals = {}
  for line in hlo_text.splitlines():
    stats = acp_jax.collective_stats(line)
    if not stats:
      continue
    assert set(stats) == {"all-reduce"}, line
    groups = re.search(r"replica_groups=(\{[{}0-9,]*\})", line)[1]
    axis = axes_of[_groups(groups)]
    totals[axis] = totals.get(axis, 0) + stats["all-reduce"].bytes
  return totals


def test_compiled_hierarchical_step_sends_the_accounting_by_axis():
  dp = hierarchical(acp_jax.acp_sgd(2))
  tx = dp.chain(optax.adam(1e-3))
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  x, y = jax.device_put((X, Y), NamedSharding(dp.mesh, dp.device_spec))
  state = tx.init(params)
  volumes = dp.comm_bytes(params)
  dense = sum(x.nbytes for x in PARAMS.values())
  assert set(volumes) == {"data", "local"}
  step = make_step(dp, tx)
  for phase, comm in dp.phase_states(state.comm).items():
    compiled = step.lower(params, state._replace(comm=comm), x, y).compile(
        compiler_options=NO_COMBINER
    )
    by_axis = all_reduce_bytes_by_axis(compiled.as_text(), dp.mesh)
    assert volumes["local"][phase] == acp_jax.CommVolume(all_reduce=dense)
    assert volumes["data"][phase] == acp_jax.comm_bytes(
        dp.compressor, PARAMS, num_devices=NODES
    )[phase]
    assert by_axis == {
        "local": volumes["local"][phase].total,
        "data": volumes["data"][phase].total,
        "all": 4,  # the loss
    }, phase


def test_flat_accounting_is_the_compressors():
  dp = acp_jax.DataParallel(acp_jax.topk_sgd(0.5), helpers.mesh())
  assert dp.comm_bytes(PARAMS) == {
      "data": acp_jax.comm_bytes(dp.compressor, PARAMS, num_devices=NUM_DEVICES)
  }


def test_residuals_are_stored_once_per_node():
  dp = hierarchical(acp_jax.acp_sgd(2))
  _, state, _ = train(dp, 3)
  node_of = {d: n for n, row in enumerate(dp.mesh.devices) for d in row}
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    name = jax.tree_util.keystr(path)
    if "comm.error" not in name:
      assert x.sharding.is_fully_replicated, name
      continue
    param = PARAMS[re.search(r"\['(\w+)'\]", name)[1]]
    assert x.shape == (NODES,) + param.shape, name
    assert x.sharding.spec == P("data"), name
    for device, index in x.sharding.devices_indices_map(x.shape).items():
      assert index[0] == slice(node_of[device], node_of[device] + 1), name
    # The residuals of the two nodes differ: each saw its own gradients.
    assert not np.allclose(x[0], x[1]), name


def test_misuse_is_refused():
  with pytest.raises(ValueError, match="local_axis='model' is not an axis"):
    acp_jax.DataParallel(acp_jax.ssgd(), mesh2d(), local_axis="model")
  with pytest.raises(ValueError, match="the compressor's own axis"):
    acp_jax.DataParallel(acp_jax.ssgd(), mesh2d(), local_axis="data")
  dp = hierarchical(acp_jax.ssgd())
  with pytest.raises(ValueError, match="8 devices of mesh axes 'data', 'l"):
    dp.value_and_grad(mlp_loss)(PARAMS, np.ones((12, 12)), np.ones(12))


def _launch(address, process_id, num_processes, devices):
  return subprocess.Popen(
      [
          sys.executable,
          "-m",
          "tests.hierarchical_process",
          f"--coordinator_address={address}",
          f"--num_processes={num_processes}",
          f"--process_id={process_id}",
          f"--devices={devices}",
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def _results(procs):
  outputs = helpers.finish(procs, timeout=240)
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-3000:]
  return [
      re.search(r"^RESULT (\S+) (.*)$", out, re.M).groups()
      for out, _ in outputs
  ]


@pytest.mark.slow
def test_two_processes_as_two_nodes_end_with_identical_params():
  address = f"127.0.0.1:{helpers.free_port()}"
  results = _results([_launch(address, i, 2, 2) for i in range(2)])
  (digest, losses), (other, _) = results
  assert digest == other
  # The same training on one process of 2 x 2 simulated devices.
  (_, single), = _results([_launch(address, 0, 1, 4)])
  np.testing.assert_allclose(
      np.array(losses.split(","), float), np.array(single.split(","), float),
      rtol=1e-5,
  )
