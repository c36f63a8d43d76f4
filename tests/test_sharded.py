"""ShardedDataParallel: the model sharded within a node, compressed across.

Eight simulated devices as 2 nodes x 4 devices per node, as in
``tests/test_hierarchical.py``, whose unsharded mode is the reference.
"""

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
from acp_jax import orthogonalize
from tests import helpers
from tests import test_hierarchical as th

LOCAL = th.LOCAL

# Warm-up steps, then the compressing phases (ACP-SGD: P, Q, P, ...).
COMPRESSORS = {
    "ssgd": acp_jax.ssgd,
    "sign_sgd": acp_jax.sign_sgd,
    "majority_vote": lambda: acp_jax.sign_sgd(majority_vote=True),
    "topk_sgd": lambda: acp_jax.topk_sgd(0.3),
    "power_sgd": lambda: acp_jax.power_sgd(2, warmup_steps=2),
    "acp_sgd": lambda: acp_jax.acp_sgd(2, warmup_steps=2),
}


def sharded(compressor, **kwargs):
  return acp_jax.ShardedDataParallel(
      compressor, th.mesh2d(), local_axis="local", **kwargs
  )


def train(dp, steps):
  tx = dp.chain(optax.adam(1e-2))
  params = jax.device_put(th.PARAMS, dp.param_shardings(th.PARAMS))
  state = tx.init(params)
  x, y = jax.device_put((th.X, th.Y), NamedSharding(dp.mesh, dp.device_spec))
  step = helpers.train_step(dp, tx, helpers.mlp_loss)
  trajectory = []
  for i in range(steps):
    state = dp.at_step(state, i)
    params, state, _ = step(params, state, x, y)
    trajectory.append(params)
  return trajectory, state


@pytest.mark.parametrize(
    "name",
    [
        "ssgd",
        "sign_sgd",
        pytest.param("majority_vote", marks=pytest.mark.slow),
        "topk_sgd",
        pytest.param("power_sgd", marks=pytest.mark.slow),
        pytest.param("acp_sgd", marks=pytest.mark.slow),
    ],
)
def test_sharded_updates_equal_the_hierarchical_ones(name):
  reference, _ = train(th.hierarchical(COMPRESSORS[name]()), 10)
  trajectory, state = train(sharded(COMPRESSORS[name]()), 10)
  for step, (want, got) in enumerate(zip(reference, trajectory)):
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["w1"], th.PARAMS["w1"]), step
  for x in jax.tree.leaves(trajectory[-1]):  # a quarter on each device
    assert x.sharding.shard_shape(x.shape)[0] == x.shape[0] // LOCAL
  if name not in ("ssgd", "majority_vote"):  # its node's block of residuals
    error = state.comm.error["w1"]
    assert error.shape == (th.NODES,) + th.PARAMS["w1"].shape
    assert error.sharding.spec == P("data", "local")


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compiled_sharded_step_sends_the_accounting_by_axis(name):
  dp = sharded(COMPRESSORS[name]())
  tx = dp.chain(optax.adam(1e-3))
  params = jax.device_put(th.PARAMS, dp.param_shardings(th.PARAMS))
  x, y = jax.device_put((th.X, th.Y), NamedSharding(dp.mesh, dp.device_spec))
  state = tx.init(params)
  volumes = dp.comm_bytes(params)
  across = th.hierarchical(COMPRESSORS[name]()).comm_bytes(th.PARAMS)["data"]
  step = helpers.train_step(dp, tx, helpers.mlp_loss)
  phases = dp.phase_states(state.comm)
  # The warm-up's dense phase, then the compressing ones.
  assert len(phases) == {"power_sgd": 2, "acp_sgd": 3}.get(name, 1)
  for phase, comm in phases.items():
    compiled = step.lower(params, state._replace(comm=comm), x, y).compile(
        compiler_options=helpers.ONE_BY_ONE
    )
    assert th.bytes_by_axis(compiled.as_text(), dp.mesh) == {
        "local": volumes["local"][phase],
        "data": volumes["data"][phase],
        "all": acp_jax.CommVolume(all_reduce=4),  # the loss
    }, phase
    # Across nodes, what the hierarchical mode sends (every leaf here
    # splits into 4 without padding).
    assert volumes["data"][phase] == across[phase], phase
    # The forward's all-gather of the params is on the local axis.
    assert volumes["local"][phase].all_gather >= sum(
        v.nbytes for v in th.PARAMS.values()
    )


def test_memory_per_device_is_a_quarter_of_the_hierarchical_modes():
  comp = lambda: acp_jax.acp_sgd(2)
  tx = optax.adamw(1e-3)
  whole = acp_jax.memory_per_device(th.hierarchical(comp()), th.PARAMS, tx)
  mine = acp_jax.memory_per_device(sharded(comp()), th.PARAMS, tx)
  f32 = 4
  params = sum(v.size for v in th.PARAMS.values()) * f32  # w1, b1, w2
  matrices = (12 * 32 + 32 * 5) * f32
  p, q = (12 * 2 + 32 * 2) * f32, (32 * 2 + 5 * 2) * f32
  count, phase = 4, 1
  assert whole == acp_jax.MemoryPerDevice(
      params=params,
      opt_state=2 * params + count,
      compressor=matrices + p + q + phase + count,
  )
  assert mine == acp_jax.MemoryPerDevice(
      params=params // LOCAL,
      opt_state=2 * params // LOCAL + count,
      compressor=(matrices + p) // LOCAL + q + phase + count,
  )


def test_memory_of_bert_base_with_adamw_within_a_twentieth_of_a_quarter():
  nnx = pytest.importorskip("flax.nnx")
  from train import models

  model = nnx.eval_shape(lambda: models.Bert(rngs=nnx.Rngs(0), size="base"))
  params = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
      nnx.to_pure_dict(nnx.state(model, nnx.Param)),
  )
  tx = optax.adamw(1e-4)
  whole = acp_jax.memory_per_device(
      th.hierarchical(acp_jax.acp_sgd(32)), params, tx
  )
  mine = acp_jax.memory_per_device(sharded(acp_jax.acp_sgd(32)), params, tx)
  # The word embedding, 30522 x 768, is sharded over its hidden axis.
  assert whole.params == 109_514_298 * 4
  assert mine.total <= whole.total / LOCAL * 1.05
  assert mine.params < whole.params / LOCAL * 1.001


def _orthogonalized_blocks(x):
  """``orthogonalize.orthogonalize_rows`` of ``x``'s blocks of rows, one per
  device of the local axis, within ``row_shards``; the blocks put back."""

  def body(block):
    with collectives.row_shards("local", LOCAL):
      return orthogonalize.orthogonalize_rows(block)

  mesh = th.mesh2d()
  return jax.jit(
      jax.shard_map(
          body,
          mesh=mesh,
          in_specs=P("local"),
          out_specs=P("local"),
          check_vma=False,
      )
  )(x)


def test_row_sharded_orthogonalization_spans_what_one_device_spans():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 4)).astype(np.float32)
  q = np.asarray(_orthogonalized_blocks(x))
  np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-5)
  whole = np.asarray(orthogonalize.orthogonalize(jnp.asarray(x)))
  np.testing.assert_allclose(q @ q.T, whole @ whole.T, atol=1e-5)


def test_row_sharded_orthogonalization_is_safe_on_zero_and_deficient_input():
  q = np.asarray(_orthogonalized_blocks(np.zeros((64, 4), np.float32)))
  np.testing.assert_array_equal(q, 0)
  # Rank 2 in 4 columns: the basis spans the input's columns, the rest zero.
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 2)).astype(np.float32)
  x = np.concatenate([x, x @ np.array([[1.0, 2.0], [0.5, -1.0]])], axis=1)
  q = np.asarray(_orthogonalized_blocks(x.astype(np.float32)))
  assert np.isfinite(q).all()
  projection = q @ q.T
  np.testing.assert_allclose(projection @ x, x, atol=1e-4)
  np.testing.assert_allclose(np.trace(projection), 2, atol=1e-4)


def test_a_nonfinite_gradient_on_one_device_keeps_every_shard():
  dp = sharded(acp_jax.acp_sgd(2))
  params = jax.device_put(th.PARAMS, dp.param_shardings(th.PARAMS))
  comm = dp.init_comm(params)
  rng = np.random.default_rng(2)
  local = {
      k: rng.standard_normal((th.NUM_DEVICES,) + v.shape).astype(np.float32)
      for k, v in th.PARAMS.items()
  }
  # On a device of node 1; summed over the node, it is in the block of rows
  # of its first device only.
  local["w1"][5, 0, 0] = np.nan
  grads = jax.device_put(local, NamedSharding(dp.mesh, dp.device_spec))
  _, state = jax.jit(dp.compress)(grads, comm)
  np.testing.assert_array_equal(state.error["w1"], comm.error["w1"])
  np.testing.assert_array_equal(state.p["w2"], comm.p["w2"])


def test_misuse_is_refused():
  with pytest.raises(ValueError, match="needs local_axis"):
    acp_jax.ShardedDataParallel(acp_jax.ssgd(), th.mesh2d(), local_axis=None)
  with pytest.raises(ValueError, match="local_axis='model' is not an axis"):
    sharded_on = acp_jax.ShardedDataParallel
    sharded_on(acp_jax.ssgd(), th.mesh2d(), local_axis="model")


def test_a_custom_compressor_is_refused():
  mine = acp_jax.ssgd()
  custom = acp_jax.Compressor(
      mine.init, mine.update, lambda *_: {}, axis_name="data"
  )
  with pytest.raises(ValueError, match="not a custom compressor, whose sums"):
    sharded(custom)


def test_resumes_bitwise_from_a_sharded_checkpoint(tmp_path):
  from acp_jax import checkpoint

  dp = sharded(acp_jax.acp_sgd(2, warmup_steps=1))
  tx = dp.chain(optax.adam(1e-2))
  x, y = jax.device_put((th.X, th.Y), NamedSharding(dp.mesh, dp.device_spec))
  step = helpers.train_step(dp, tx, helpers.mlp_loss)

  def run(params, state, start, stop):
    for i in range(start, stop):
      params, state, _ = step(params, dp.at_step(state, i), x, y)
    return params, state

  params = jax.device_put(th.PARAMS, dp.param_shardings(th.PARAMS))
  fresh = tx.init(params)
  params, state = run(params, fresh, 0, 4)  # then a Q-step
  assert state.comm.next_phase is acp_jax.Phase.Q
  checkpoint.save(tmp_path / "ckpt", (params, state), compressor=dp.compressor)
  want = run(params, state, 4, 7)
  like = (jax.device_put(th.PARAMS, dp.param_shardings(th.PARAMS)), fresh)
  restored = checkpoint.restore(
      tmp_path / "ckpt", like, compressor=dp.compressor
  )
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
    assert a.sharding == b.sharding
  got = run(*restored, 4, 7)
  chex.assert_trees_all_equal(got, want)


@pytest.mark.slow
def test_nnx_model_with_sharding_annotations_in_its_own_loop():
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):

    def __init__(self, rngs):
      kernel = nnx.initializers.lecun_normal()
      self.hidden = nnx.Linear(
          12,
          32,
          kernel_init=nnx.with_partitioning(kernel, ("local", None)),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("local",)),
          rngs=rngs,
      )
      self.out = nnx.Linear(
          32,
          5,
          kernel_init=nnx.with_partitioning(kernel, ("local", None)),
          rngs=rngs,
      )

    def __call__(self, x):
      return self.out(jax.nn.relu(self.hidden(x)))

  def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def run(dp, place):
    # Under flax's eager sharding (its default) the annotations also go on
    # the optimizer's state that nnx.Optimizer makes from the params, but
    # not on the compressor's, whose residuals are stacked per node.
    assert nnx.using_eager_sharding()
    with jax.set_mesh(dp.mesh):
      model = MLP(nnx.Rngs(0))
      state = nnx.state(model)
      nnx.update(model, jax.device_put(state, place(state)))
      tx = dp.chain(optax.adam(1e-2))
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
      loss, grads = dp.value_and_grad(loss_fn)(model, x, y)
      optimizer.update(model, grads)
      return loss

    x, y = jax.device_put((th.X, th.Y), NamedSharding(dp.mesh, dp.device_spec))
    for i in range(4):
      dp.at_step(optimizer, i)
      train_step(model, optimizer, x, y)
    return nnx.state(model, nnx.Param)

  dp = sharded(acp_jax.acp_sgd(2))
  annotated = lambda state: nnx.get_named_sharding(state, dp.mesh)
  got = run(dp, annotated)
  reference = th.hierarchical(acp_jax.acp_sgd(2))
  want = run(reference, reference.param_shardings)
  chex.assert_trees_all_close(
      nnx.to_pure_dict(got), nnx.to_pure_dict(want), rtol=1e-5, atol=1e-6
  )
  kernel = got["hidden"]["kernel"].get_value()
  assert kernel.sharding.spec == P("local")
  assert kernel.sharding == dp.param_shardings(kernel)


@pytest.mark.parametrize(
    "name", ["sign_sgd", "topk_sgd", "power_sgd", "acp_sgd"]
)
def test_leaves_that_the_local_axis_does_not_divide_compress_alike(name):
  # 6 rows pad to 8 (the param sharded on its columns), 5 and a scalar stay
  # whole on every device.
  params = {
      "a": jax.ShapeDtypeStruct((6, 32), jnp.float32),
      "c": jax.ShapeDtypeStruct((5,), jnp.float32),
      "s": jax.ShapeDtypeStruct((), jnp.float32),
  }
  # Sign-SGD's scale and Top-k's k are the unpadded leaf's.
  make = helpers.COMPRESSORS[name]
  mine, whole = sharded(make()), th.hierarchical(make())
  assert [mine.param_spec(x.shape) for x in params.values()] == [
      P(None, "local"),
      P(),
      P(),
  ]
  state, reference = mine.init_comm(params), whole.init_comm(params)
  rng = np.random.default_rng(3)
  for _ in range(3):
    local = {
        k: rng.standard_normal((th.NUM_DEVICES,) + v.shape).astype(np.float32)
        for k, v in params.items()
    }
    grads = jax.device_put(local, NamedSharding(mine.mesh, mine.device_spec))
    mean, state = jax.jit(mine.compress)(grads, state)
    want, reference = jax.jit(whole.compress)(grads, reference)
    # Means of order 1 agree to float32 rounding of their scale.
    chex.assert_trees_all_close(mean, want, rtol=1e-5, atol=1e-5)
    assert mean["a"].sharding.spec == P(None, "local")
