"""The compressor as a value, and the registry of compressors.

Every factory's result copies, replaces, compares and pickles as a value
does; a compressor registered through ``acp_jax.registry`` alone is one
that ``DataParallel`` and the trainer's config take.
"""

import copy
import dataclasses
import pickle
import typing

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax import collectives
from acp_jax import registry
from acp_jax_tools import advice as advice_lib
from acp_jax_tools import costmodel
from tests import helpers
from configs import default
from tests.conftest import NUM_DEVICES
from train import optimizers

# Every factory with arguments that make it differ from its defaults.
MADE = {
    "ssgd": lambda: acp_jax.ssgd(bucket_bytes=1024),
    "sign_sgd": lambda: acp_jax.sign_sgd(majority_vote=True),
    "topk_sgd": lambda: acp_jax.topk_sgd(0.25),
    "power_sgd": lambda: acp_jax.power_sgd(2, warmup_steps=1),
    "acp_sgd": lambda: acp_jax.acp_sgd(2, seed=3),
}


def test_every_registered_factory_is_covered():
  assert set(registry.names()) == set(MADE)


@pytest.mark.parametrize("name", sorted(MADE))
def test_a_compressor_prints_the_call_that_made_it(name):
  made = MADE[name]()
  shown = repr(made)
  assert shown == str(made) and shown.startswith(f"{name}(")
  # Every argument is there, as the factory takes it: the call remakes it.
  factory = {name: registry.get(name).factory}
  assert eval(shown, factory) == made  # pylint: disable=eval-used


def test_a_compressor_prints_its_arguments_in_the_factorys_order():
  assert repr(acp_jax.acp_sgd(rank=4)).startswith(
      "acp_sgd(rank=4, axis_name='data', min_compression_rate=2.0, seed=0,"
  )
  low = repr(acp_jax.power_sgd(2, comm_dtype=jnp.bfloat16, warmup_steps=3))
  assert "comm_dtype='bfloat16'" in low and "warmup_steps=3" in low
  # Without made_by: its functions by name and its settings, no address.
  custom = repr(acp_jax.ssgd()._replace(warmup_steps=3))
  assert custom.startswith("Compressor(init='acp_jax.")
  assert "warmup_steps=3" in custom and " at 0x" not in custom


def one_update(tx):
  """``tx``'s update of fixed gradients, from its init, on every device."""
  grads = helpers.random_grads(0, helpers.MIXED)
  state = helpers.replicate(tx.init(helpers.MIXED))
  return helpers.to_numpy(helpers.mapped(tx.update, "shard_map")(grads, state))


@pytest.mark.parametrize("name", sorted(MADE))
def test_copies_and_pickles_are_equal_and_update_alike(name):
  made = MADE[name]()
  copies = {
      "copy": copy.copy(made),
      "deepcopy": copy.deepcopy(made),
      "pickle": pickle.loads(pickle.dumps(made)),
  }
  for how, c in copies.items():
    assert isinstance(c, acp_jax.Compressor), how
    assert c == made and hash(c) == hash(made), how
    assert c.spec.made_by == made.made_by, how
    assert (c.cycle, c.warmup_steps, c.bucket_bytes) == (
        made.cycle,
        made.warmup_steps,
        made.bucket_bytes,
    ), how
  assert copies["copy"].init is made.init
  if name in ("sign_sgd", "ssgd"):  # one update of each is enough here
    chex.assert_trees_all_equal(one_update(copies["pickle"]), one_update(made))


@pytest.mark.parametrize("name", sorted(MADE))
def test_replace_keeps_every_setting_and_what_made_it_only_unchanged(name):
  made = MADE[name]()
  same = made._replace(init=made.init)
  assert isinstance(same, acp_jax.Compressor)
  assert same == made and same.spec == made.spec
  changed = made._replace(warmup_steps=made.warmup_steps + 2)
  assert changed.warmup_steps == made.warmup_steps + 2
  assert changed.cycle == made.cycle and changed.axis_name == made.axis_name
  factory, args = made.made_by
  if "warmup_steps" in args:  # the factory's argument: made again with it
    assert changed.made_by == (
        factory,
        {**args, "warmup_steps": made.warmup_steps + 2},
    )
  else:
    # It is no longer what the factory made: a checkpoint must not say so.
    assert changed.made_by is None and changed != made
  spec = dataclasses.replace(made.spec, bucket_bytes=512)
  rebuilt = acp_jax.Compressor.from_spec(made.init, made.update, spec)
  assert rebuilt.bucket_bytes == 512 and rebuilt.made_by == made.made_by
  with pytest.raises(TypeError, match="cylce"):
    made._replace(cylce=("p",))
  with pytest.raises(AttributeError, match="immutable"):
    made.cycle = ("p",)


@pytest.mark.parametrize("name", ["ssgd", "sign_sgd", "power_sgd", "acp_sgd"])
def test_replace_of_a_setting_the_update_took_takes_effect_or_is_refused(name):
  """The update closes over the axis it sends on: a replaced axis_name is
  the factory's compressor on that axis, which runs on a mesh of it, and a
  replaced leaf_order the factory's compressor with that order. A compressor
  that no factory made cannot change what its update took: refused, naming
  the call to make again."""
  made = MADE[name]()
  moved = made._replace(axis_name="batch")
  assert moved == registry.make(
      made.made_by[0], {**made.made_by[1], "axis_name": "batch"}
  )
  mesh = jax.make_mesh(
      (NUM_DEVICES,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  dp = acp_jax.DataParallel(moved, mesh)
  params = {"w": jnp.ones((16, 16))}
  tx = dp.chain(optax.sgd(1.0))
  x = jax.device_put(
      np.random.default_rng(0).standard_normal((8 * NUM_DEVICES, 16)),
      NamedSharding(mesh, P("batch")),
  ).astype(jnp.float32)
  _, grads = jax.jit(dp.value_and_grad(lambda p, x: jnp.mean(x @ p["w"])))(
      params, x
  )
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert np.isfinite(np.asarray(updates["w"])).all()
  if name == "ssgd":  # the exact mean
    chex.assert_trees_all_close(
        updates["w"],
        -jax.grad(lambda p: jnp.mean(x @ p["w"]))(params)["w"],
        rtol=1e-5,
    )
  reordered = made._replace(leaf_order=(0,))
  assert reordered.leaf_order == (0,)
  assert reordered == registry.make(
      made.made_by[0], {**made.made_by[1], "leaf_order": (0,)}
  )
  by_hand = acp_jax.Compressor(
      made.init, made.update, made.volume, axis_name="data"
  )
  with pytest.raises(ValueError, match=r"leaf_order.*Make the compressor again"):
    by_hand._replace(leaf_order=(0,))


def test_compressors_of_other_arguments_differ():
  assert acp_jax.acp_sgd(2) == acp_jax.acp_sgd(2)
  assert acp_jax.acp_sgd(2) != acp_jax.acp_sgd(3)
  assert acp_jax.acp_sgd(2) != acp_jax.power_sgd(2)
  assert acp_jax.acp_sgd(2) != optax.sgd(0.1)


def test_a_compressor_built_by_hand_copies_but_does_not_pickle():
  mine = acp_jax.ssgd()
  custom = acp_jax.Compressor(
      mine.init, mine.update, mine.volume, axis_name="data"
  )
  assert copy.copy(custom) == custom and copy.deepcopy(custom) == custom
  assert custom != mine
  with pytest.raises(TypeError, match="made_by=None"):
    pickle.dumps(custom)


class MeanSgdState(typing.NamedTuple):
  """The toy's state: the steps it took."""

  steps: jax.Array


def mean_sgd(*, axis_name="data", scale=1.0):
  """A toy compressor: the dense mean times ``scale``."""

  def init_fn(params):
    del params
    return MeanSgdState(steps=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    n = lax.axis_size(axis_name)
    mean = jax.tree.map(
        lambda g: collectives.all_reduce(g, axis_name) * (scale / n), updates
    )
    return mean, MeanSgdState(steps=state.steps + 1)

  def volume(params, num_devices):
    del num_devices
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return {acp_jax.phase.STEP: acp_jax.CommVolume(all_reduce=nbytes)}

  return acp_jax.Compressor(
      init_fn,
      update_fn,
      volume,
      axis_name=axis_name,
      local_fields=(),
      made_by=("mean_sgd", {"axis_name": axis_name, "scale": scale}),
  )


@pytest.fixture(name="toy")
def _toy():
  registry.register(
      registry.Entry(
          "mean_sgd",
          mean_sgd,
          "mean",
          "#000000",
          {"scale": 1.0},
          # One all-reduce a leaf, of that leaf's gradient alone.
          pipelined=True,
          state=MeanSgdState,
      )
  )
  yield
  registry.unregister("mean_sgd")


def mlp_loss(params, x, y):
  logits = jnp.tanh(x @ params["w"]) @ params["v"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_a_compressor_registered_alone_trains_through_data_parallel(toy):
  del toy
  assert "mean_sgd" in registry.names()
  config = default.get_config()
  config.compressor.name = "mean_sgd"
  config.compressor.mean_sgd.scale = 0.5
  made = optimizers.compressor(config, "data")
  assert made == mean_sgd(scale=0.5)
  assert pickle.loads(pickle.dumps(made)) == made
  rng = np.random.default_rng(0)
  params = {
      "w": rng.standard_normal((12, 16)).astype(np.float32),
      "v": rng.standard_normal((16, 5)).astype(np.float32),
  }
  x = rng.standard_normal((4 * NUM_DEVICES, 12)).astype(np.float32)
  y = rng.integers(0, 5, 4 * NUM_DEVICES)
  dp = acp_jax.DataParallel(made, helpers.mesh())
  tx = dp.chain(optax.sgd(1.0))
  params = jax.device_put(params, NamedSharding(dp.mesh, P()))
  x, y = jax.device_put((x, y), NamedSharding(dp.mesh, P("data")))

  @jax.jit
  def step(params, state, x, y):
    _, grads = dp.value_and_grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)

  got = step(params, tx.init(params), x, y)
  dense = jax.grad(mlp_loss)(params, x, y)
  want = jax.tree.map(lambda p, g: p - 0.5 * g, params, dense)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert dp.comm_bytes(params)["data"]["step"].all_reduce == 4 * (
      12 * 16 + 16 * 5
  )


def test_a_registered_compressors_state_is_checkpointed_with_its_settings(
    toy, tmp_path
):
  """The registry entry's state type is all a checkpoint needs: the save
  asks for the compressor, the restore refuses another setting."""
  del toy
  params = {"w": np.ones((4, 3), np.float32)}
  made = mean_sgd(scale=0.5)
  state = (params, made.init(params))
  with pytest.raises(ValueError, match="compressor= is missing"):
    acp_jax.checkpoint.save(str(tmp_path / "a"), state)
  acp_jax.checkpoint.save(str(tmp_path / "b"), state, compressor=made)
  restored = acp_jax.checkpoint.restore(
      str(tmp_path / "b"), state, compressor=made
  )
  chex.assert_trees_all_equal(restored, state)
  with pytest.raises(ValueError, match="scale"):
    acp_jax.checkpoint.restore(
        str(tmp_path / "b"), state, compressor=mean_sgd(scale=0.25)
    )


def test_the_advice_and_the_cost_model_take_a_registered_compressor(toy):
  """Its entry is all they read: the advice weighs it, made with its
  config's values, and the cost model takes its rounds and whether it
  overlaps backprop from it."""
  del toy
  candidates = advice_lib.default_candidates("cpu", ranks=(2,))
  assert candidates[-1] == advice_lib.Candidate("mean_sgd")
  assert candidates[-1].make() == mean_sgd(scale=1.0)
  params = {"w": jnp.ones((12, 16), jnp.float32)}
  sent = advice_lib.volumes(candidates, params, 4)
  assert sent["mean_sgd"]["step"].all_reduce == 4 * 12 * 16
  link = advice_lib.Link(bandwidth=1e6, latency=1e-4)
  advice = advice_lib.recommend(
      advice_lib.Measurements(
          forward_backward=0.01,
          update={c.name: 1e-4 for c in candidates},
          error_to_noise={c.name: 0.0 for c in candidates},
      ),
      sent,
      candidates,
      workers=4,
      link=link,
      global_batch=8,
      calibration=advice_lib.Calibration.recorded(),
      overlap=True,
  )
  row = next(r for r in advice.rows if r.candidate.name == "mean_sgd")
  (traffic,) = costmodel.traffic(sent["mean_sgd"], "mean_sgd")
  assert traffic.all_reduce_ops == 1
  comm = traffic.seconds(4, link.costs())
  backward = costmodel.BACKWARD_SHARE * 0.01
  assert row.step_s == pytest.approx(0.01 + 1e-4 + comm - min(comm, backward))
  # The same compressor in two dependent rounds, communicating after
  # backprop: the cost model prices it so, with no edit of its own.
  registry.register(
      dataclasses.replace(
          registry.get("mean_sgd"), name="mean_sgd_2", rounds=2, pipelined=False
      )
  )
  try:
    (twice,) = costmodel.traffic(sent["mean_sgd"], "mean_sgd_2")
    assert twice.all_reduce_ops == 2
    assert costmodel.step_seconds(
        0.01, backward, twice, "mean_sgd_2", 4, link.costs(), overlap=True
    ) == pytest.approx(0.01 + twice.seconds(4, link.costs()))
  finally:
    registry.unregister("mean_sgd_2")
