"""Hierarchical DataParallel: a dense mean within a node, compression across.

Eight simulated devices as 2 nodes x 4 devices per node; the node axis is
the compressor's ("data"), the local one "local".
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from acp_jax import collectives
from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES
from tests.helpers import COMPRESSORS
from tests.helpers import mlp_loss

NODES, LOCAL = 2, NUM_DEVICES // 2
RNG = np.random.default_rng(0)
X = RNG.standard_normal((4 * NUM_DEVICES, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 4 * NUM_DEVICES)
PARAMS = {
    "w1": RNG.standard_normal((12, 32)).astype(np.float32) / 4,
    "b1": np.zeros(32, np.float32),
    "w2": RNG.standard_normal((32, 5)).astype(np.float32) / 6,
}
# No all-reduce is merged with another, so each one's group says its axis.


def mesh2d():
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh(
      (NODES, LOCAL), ("data", "local"), axis_types=(auto, auto)
  )


def hierarchical(compressor):
  return acp_jax.DataParallel(compressor, mesh2d(), local_axis="local")


def train(dp, steps, lr=0.1):
  tx = dp.chain(optax.sgd(lr, momentum=0.9))
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  state = tx.init(params)
  x, y = jax.device_put((X, Y), NamedSharding(dp.mesh, dp.device_spec))
  step = helpers.train_step(dp, tx, mlp_loss)
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
  grads = grads.stacked
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


def _mesh_groups(line: str) -> frozenset[tuple[int, ...]] | None:
  """The groups of a ``replica_groups=mesh[...]`` value, as XLA prints the
  collectives its sharding inserts: device ids (an iota reshaped and
  maybe transposed) on named mesh axes, grouped over the axes in braces."""
  m = re.search(
      r"replica_groups=mesh\[([^\]]*)\], device_ids=\(\[([0-9,]+)\]"
      r"(?:T\(([0-9,]+)\))?\) \{([^}]*)\}",
      line,
  )
  if m is None:
    return None
  axes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", m[1])]
  dims = [int(d) for d in m[2].split(",")]
  perm = [int(p) for p in m[3].split(",")] if m[3] else range(len(dims))
  ids = np.arange(np.prod(dims)).reshape(dims).transpose(perm)
  ids = ids.reshape([n for _, n in axes])
  names = set(re.findall(r"'(\w+)'", m[4]))
  grouped = [i for i, (a, _) in enumerate(axes) if a in names]
  size = int(np.prod([axes[i][1] for i in grouped]))
  rows = np.moveaxis(ids, grouped, range(-len(grouped), 0)).reshape(-1, size)
  return frozenset(tuple(sorted(row.tolist())) for row in rows)


def bytes_by_axis(hlo_text: str, mesh) -> dict[str, acp_jax.CommVolume]:
  """All-reduce and all-gather result bytes per device, by the mesh axes
  each collective runs over (read from its replica groups: positions in the
  mesh); "all" for the loss's mean over both axes."""
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  axes_of = {
      frozenset(tuple(row) for row in ids.tolist()): "local",
      frozenset(tuple(col) for col in ids.T.tolist()): "data",
      frozenset([tuple(ids.ravel().tolist())]): "all",
  }
  kinds = {"all-reduce": "all_reduce", "all-gather": "all_gather"}
  totals = {}
  for line in hlo_text.splitlines():
    stats = hlo.collective_stats(line)
    if not stats:
      continue
    (kind, stat), = stats.items()
    assert kind in kinds, line
    groups = _mesh_groups(line)
    if groups is None:
      groups = _groups(re.search(r"replica_groups=(\{[{}0-9,]*\})", line)[1])
    axis = axes_of[groups]
    volume = totals.get(axis, acp_jax.CommVolume())
    totals[axis] = volume._replace(
        **{kinds[kind]: getattr(volume, kinds[kind]) + stat.bytes}
    )
  return totals


def node_mesh():
  """A 1-D mesh of NODES devices: one per node, nothing to split."""
  return jax.make_mesh(
      (NODES,),
      ("data",),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[:NODES],
  )


def flat_buffers(make, phase: str) -> list[collectives.Sent]:
  """The buffers that ``make()``'s compressor sends in ``phase`` without a
  split, over a 1-D mesh of NODES devices, as traced."""
  dp = acp_jax.DataParallel(make(), node_mesh())
  comm = dp.phase_states(dp.abstract_comm(PARAMS))[phase]
  with collectives.recording() as sent:
    jax.eval_shape(dp.compress, dp.abstract_local_grads(PARAMS), comm)
  return sent


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compiled_hierarchical_step_sends_the_accounting_by_axis(name):
  dp = hierarchical(COMPRESSORS[name]())
  tx = dp.chain(optax.adam(1e-3))
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  x, y = jax.device_put((X, Y), NamedSharding(dp.mesh, dp.device_spec))
  state = tx.init(params)
  volumes = dp.comm_bytes(params)
  flat = acp_jax.comm_bytes(dp.compressor, PARAMS, num_devices=NODES)
  dense = sum(x.nbytes for x in PARAMS.values())
  assert set(volumes) == {"data", "local"}
  step = helpers.train_step(dp, tx, mlp_loss)
  for phase, comm in dp.phase_states(state.comm).items():
    compiled = step.lower(params, state._replace(comm=comm), x, y).compile(
        compiler_options=helpers.ONE_BY_ONE
    )
    by_axis = bytes_by_axis(compiled.as_text(), dp.mesh)
    assert by_axis == {
        "local": volumes["local"][phase],
        "data": volumes["data"][phase],
        "all": acp_jax.CommVolume(all_reduce=4),  # the loss
    }, phase
    # Across nodes, each device sends its chunk of every buffer that the
    # flat compressor sends whole, padded to a multiple of LOCAL elements.
    buffers = flat_buffers(COMPRESSORS[name], phase)
    assert sum(b.nbytes for b in buffers) == flat[phase].total
    chunks = [b._replace(size=-(-b.size // LOCAL)) for b in buffers]
    node = volumes["data"][phase]
    assert node.total == sum(c.nbytes for c in chunks), phase
    padding = sum(
        jnp.dtype(b.dtype).itemsize * (NODES if b.kind == "all_gather" else 1)
        for b in buffers
    )
    assert flat[phase].total / LOCAL <= node.total
    assert node.total < flat[phase].total / LOCAL + padding, phase
    # Within a node, the dense mean and the chunks gathered back.
    gathered = sum(LOCAL * c.nbytes for c in chunks)
    assert volumes["local"][phase] == acp_jax.CommVolume(
        all_reduce=dense, all_gather=gathered
    ), phase


@pytest.mark.parametrize("name", COMPRESSORS)
def test_split_exchange_equals_the_flat_one_on_node_means(name):
  # The compressor across nodes sees each node's mean gradient: with its
  # buffers split over the local axis it must give what the same compressor
  # gives, sending every buffer whole, on one device per node fed those
  # means. Gradients are multiples of 1/16, so the means are exact.
  dp = hierarchical(COMPRESSORS[name]())
  flat = acp_jax.DataParallel(COMPRESSORS[name](), node_mesh())
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
  state, flat_state = dp.init_comm(shapes), flat.init_comm(shapes)
  compress, flat_compress = jax.jit(dp.compress), jax.jit(flat.compress)
  rng = np.random.default_rng(1)
  for step in range(4):  # ACP-SGD: P, Q, P, Q
    local = {
        k: rng.integers(-32, 33, (NUM_DEVICES,) + v.shape).astype(np.float32)
        / 16
        for k, v in PARAMS.items()
    }
    means = {
        k: v.reshape((NODES, LOCAL) + v.shape[1:]).mean(1)
        for k, v in local.items()
    }
    mean, state = jax.block_until_ready(
        compress(
            jax.device_put(local, NamedSharding(dp.mesh, dp.device_spec)),
            state,
        )
    )
    flat_mean, flat_state = jax.block_until_ready(
        flat_compress(
            jax.device_put(means, NamedSharding(flat.mesh, flat.device_spec)),
            flat_state,
        )
    )
    chex.assert_trees_all_close(mean, flat_mean, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state, flat_state, rtol=1e-5, atol=1e-6)
  if name != "ssgd":  # the comparison saw compressed, not exact, means
    exact = jax.tree.map(lambda x: x.mean(0), local)
    assert not np.allclose(mean["w1"], exact["w1"], atol=1e-3)


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


def _launch(processes, devices):
  return helpers.launch(
      ["-m", "tests.hierarchical_process", f"--devices={devices}"], processes
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
  results = _results(_launch(2, 2))
  (digest, losses), (other, _) = results
  assert digest == other
  # The same training on one process of 2 x 2 simulated devices.
  (_, single), = _results(_launch(1, 4))
  np.testing.assert_allclose(
      np.array(losses.split(","), float), np.array(single.split(","), float),
      rtol=1e-5,
  )
