"""Misuse raises early, naming the argument and the value."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from tests import helpers
from tests.test_suite import all_compressors
from tests.test_suite import COMPRESSORS


@pytest.mark.parametrize("factory", [acp_jax.power_sgd, acp_jax.acp_sgd])
@pytest.mark.parametrize("rank", [0, -2, 2.0, True, "4", None])
def test_rank_must_be_a_positive_int(factory, rank):
  with pytest.raises(
      ValueError, match=re.escape(f"rank must be a positive int, got {rank!r}")
  ):
    factory(rank)


@pytest.mark.parametrize("factory", [acp_jax.power_sgd, acp_jax.acp_sgd])
@pytest.mark.parametrize("seed", [-1, np.int64(-3), 0.5, True, "0", None])
def test_seed_must_be_a_non_negative_int(factory, seed):
  with pytest.raises(
      ValueError,
      match=re.escape(f"seed must be a non-negative int, got {seed!r}"),
  ):
    factory(4, seed=seed)
  assert factory(4, seed=np.int64(3)).made_by[1]["seed"] == 3


@pytest.mark.parametrize("factory", [acp_jax.power_sgd, acp_jax.acp_sgd])
@pytest.mark.parametrize("rate", [-1, -0.5, float("nan"), "2"])
def test_min_compression_rate_must_be_non_negative(factory, rate):
  with pytest.raises(ValueError, match=re.escape(f"got {rate!r}")):
    factory(4, min_compression_rate=rate)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_density_must_be_in_unit_interval(density):
  with pytest.raises(
      ValueError,
      match=re.escape(f"density must be a number in (0, 1], got {density!r}"),
  ):
    acp_jax.topk_sgd(density)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: acp_jax.ssgd(comm_dtype=jnp.int8),
            "comm_dtype must be a floating dtype",
        ),
        (
            lambda: acp_jax.ssgd(comm_dtype="bogus"),
            "comm_dtype must be a floating dtype",
        ),
        (
            lambda: acp_jax.sign_sgd(majority_vote="yes"),
            "majority_vote must be a bool, got 'yes'",
        ),
    ],
)
def test_bad_options(make, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    make()


def _power_sgd_mean(grads, comm_dtype):
  """Power-SGD's mean of the devices' ``grads``, factors in ``comm_dtype``."""
  tx = acp_jax.power_sgd(1, comm_dtype=comm_dtype, warm_start=False)
  params = {"w": jnp.zeros(grads["w"].shape[1:], jnp.float32)}
  update = helpers.mapped(tx.update, "shard_map")
  mean, _ = update(helpers.shard(grads), helpers.replicate(tx.init(params)))
  return np.asarray(mean["w"][0])


@pytest.mark.parametrize(
    "factory",
    [
        acp_jax.ssgd,
        lambda **options: acp_jax.power_sgd(4, **options),
        lambda **options: acp_jax.acp_sgd(4, **options),
    ],
    ids=["ssgd", "power_sgd", "acp_sgd"],
)
def test_a_float16_comm_dtype_warns_of_overflow_naming_bfloat16(factory):
  """Factors all-reduced in float16 overflowed to inf and the params went
  NaN, with nothing naming comm_dtype; bfloat16 has float32's range."""
  message = (
      r"comm_dtype=float16 holds no value past 65504: a value sent, or its"
      r" sum over the devices, beyond it .* becomes inf.*"
      r" comm_dtype=jnp\.bfloat16"
  )
  with pytest.warns(UserWarning, match=message):
    factory(comm_dtype=jnp.float16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    factory(comm_dtype=jnp.bfloat16)
    factory(comm_dtype=jnp.float32)


def test_the_float16_overflow_warned_of_is_real_and_bfloat16_holds():
  """A rank-one gradient of entries 3000 on 64 x 64, as a loss spike gives:
  the factors' entries (64 of them along a unit vector) reach thousands,
  and their sum over the 8 devices passes 65504 in float16."""
  grads = {"w": np.full((helpers.NUM_DEVICES, 64, 64), 3000.0, np.float32)}
  with pytest.warns(UserWarning, match="comm_dtype=float16"):
    assert not np.all(np.isfinite(_power_sgd_mean(grads, jnp.float16)))
  np.testing.assert_allclose(
      _power_sgd_mean(grads, jnp.bfloat16), grads["w"][0], rtol=1e-2
  )


@all_compressors
@pytest.mark.parametrize("bucket_bytes", [0, -1, float("nan"), True, "25MB"])
def test_bucket_bytes_must_be_positive(name, bucket_bytes):
  message = (
      "bucket_bytes must be a positive number (math.inf for one bucket), got"
      f" {bucket_bytes!r}"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    COMPRESSORS[name].make(bucket_bytes=bucket_bytes)


@pytest.mark.parametrize(
    "make",
    [
        lambda: acp_jax.acp_sgd(4, rnak=2),
        lambda: acp_jax.power_sgd(4, axis="data"),
        lambda: acp_jax.topk_sgd(0.1, error_feedback=False),
        lambda: acp_jax.ssgd(4),
    ],
)
def test_unknown_options(make):
  with pytest.raises(TypeError, match="argument"):
    make()


@all_compressors
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_init_rejects_non_real_float_leaves(name, dtype):
  params = {"ok": jnp.zeros((4, 4)), "step": jnp.zeros((3,), dtype)}
  with pytest.raises(TypeError, match=re.escape("leaf ['step'] has dtype")):
    COMPRESSORS[name].make().init(params)


@all_compressors
def test_update_outside_a_mapped_context(name):
  tx = COMPRESSORS[name].make()
  params = {"w": jnp.zeros((8, 8))}
  with pytest.raises(
      ValueError, match="axis_name='data' is not bound.*jax.shard_map.*jax.pmap"
  ):
    jax.jit(tx.update)(params, tx.init(params))


@all_compressors
def test_update_over_another_axis(name):
  tx = COMPRESSORS[name].make()
  params = {"w": jnp.zeros((8, 8))}
  state = helpers.replicate(tx.init(params))
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    jax.pmap(tx.update, axis_name="batch")(helpers.replicate(params), state)


@all_compressors
def test_gradients_already_reduced_by_grad(name):
  """jax.grad with respect to params replicated under shard_map."""
  tx = COMPRESSORS[name].make()
  params = {"w": jnp.zeros((16, 12))}
  P = jax.sharding.PartitionSpec

  def step(params, state, x):
    g = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    return tx.update(g, jax.tree.map(lambda a: a[0], state))[0]

  f = jax.jit(
      jax.shard_map(
          step,
          mesh=helpers.mesh(),
          in_specs=(P(), P("data"), P("data")),
          out_specs=P(),
      )
  )
  with pytest.raises(
      ValueError, match=re.escape("lax.pcast(params, 'data', to='varying')")
  ):
    f.lower(params, helpers.replicate(tx.init(params)), jnp.ones((64, 16)))


@pytest.mark.parametrize(
    "name", ["sign_sgd", "topk_sgd", "power_sgd", "acp_sgd"]
)
@pytest.mark.parametrize(
    "grads, message",
    [
        (
            {"w": jnp.zeros((16, 12)), "extra": jnp.zeros(3)},
            "does not match the tree",
        ),
        ({"w": jnp.zeros((12, 16)), "b": jnp.zeros(12)}, "has shape (12, 16)"),
    ],
)
def test_update_with_another_tree(name, grads, message):
  tx = COMPRESSORS[name].make()
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros(12)}
  update = helpers.mapped(tx.update, "pmap")
  with pytest.raises(ValueError, match=re.escape(message)):
    update(helpers.replicate(grads), helpers.replicate(tx.init(params)))


def test_state_of_another_compressor():
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros(12)}
  state = helpers.replicate(acp_jax.power_sgd(2).init(params))
  other = acp_jax.power_sgd(2, keep_dense={"w": True, "b": True})
  with pytest.raises(ValueError, match="the state was initialized to compress"):
    helpers.mapped(other.update, "pmap")(helpers.replicate(params), state)


@pytest.mark.parametrize(
    "saved, now, error, message",
    [
        (lambda: acp_jax.power_sgd(2), lambda: acp_jax.acp_sgd(2), TypeError, "acp_sgd was given a PowerSgdState"),
        (lambda: acp_jax.topk_sgd(0.5), lambda: acp_jax.sign_sgd(), TypeError, "sign_sgd was given a TopkSgdState"),
        (lambda: acp_jax.acp_sgd(2), lambda: acp_jax.acp_sgd(3), ValueError, r"acp_sgd\(rank=3\) .* \(12, 2\), not \(12, 3\)"),
        (lambda: acp_jax.power_sgd(2), lambda: acp_jax.power_sgd(3), ValueError, "made with another rank"),
    ],
)
def test_update_refuses_a_state_made_by_another_compressor(saved, now, error, message):
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros(12)}
  state = helpers.replicate(saved().init(params))
  with pytest.raises(error, match=message):
    helpers.mapped(now().update, "pmap")(helpers.replicate(params), state)


def test_keep_dense_of_another_tree():
  tx = acp_jax.acp_sgd(2, keep_dense={"w": True})
  with pytest.raises(
      ValueError, match="keep_dense must give a tree of bools like the params"
  ):
    tx.init({"w": jnp.zeros((16, 12)), "b": jnp.zeros(12)})


def test_comm_bytes_needs_the_compressor_itself():
  chained = optax.chain(acp_jax.acp_sgd(4), optax.sgd(0.1))
  with pytest.raises(TypeError, match="pass the compressor itself"):
    acp_jax.comm_bytes(chained, {"w": jnp.zeros((4, 4))}, num_devices=8)
  with pytest.raises(
      ValueError, match="num_devices must be a positive int, got 0"
  ):
    acp_jax.comm_bytes(acp_jax.ssgd(), {"w": jnp.zeros((4, 4))}, num_devices=0)


@pytest.mark.parametrize("factory", [acp_jax.power_sgd, acp_jax.acp_sgd])
def test_rank_that_compresses_nothing_warns(factory):
  params = {"w": jnp.zeros((64, 32)), "conv": jnp.zeros((3, 3, 4, 8))}
  with pytest.warns(
      UserWarning,
      match=re.escape(
          "no matrix leaf is compressed at rank=1000000 and"
          " min_compression_rate=2.0 (the largest, (64, 32),"
      ),
  ):
    factory(1_000_000).init(params)


@pytest.mark.parametrize(
    "params, keep_dense",
    [
        ({"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}, None),
        # Nothing compressed, but only because the user asked for it.
        ({"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}, {"w": True, "b": False}),
        ({"b": jnp.zeros(32), "scale": jnp.zeros(())}, None),  # no matrix
    ],
)
def test_rank_that_compresses_something_does_not_warn(params, keep_dense):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    acp_jax.power_sgd(4, keep_dense=keep_dense).init(params)


@pytest.mark.parametrize("nonfinite", ["keep", "skip"])
@pytest.mark.parametrize(
    "tx, sign",
    [
        (optax.sgd(float("nan")), "NaN or infinite"),
        (optax.adam(float("inf")), "NaN or infinite"),
        (optax.sgd(-0.5), "negative"),
        (optax.chain(optax.clip(1.0), optax.lion(-1e-3)), "negative"),
    ],
)
def test_a_nan_infinite_or_negative_learning_rate_is_refused_at_chain(
    tx, sign, nonfinite
):
  """optax keeps the learning rate in a closure: the update of a gradient
  of ones shows it, at DataParallel.chain and acp_jax.chain, where a NaN
  one would turn every param NaN (with nonfinite='skip' too) and a negative
  one climb the loss."""
  dp = acp_jax.DataParallel(
      acp_jax.ssgd(), helpers.mesh(), nonfinite=nonfinite
  )
  with pytest.raises(ValueError, match=rf"DataParallel\.chain.*{sign}"):
    dp.chain(tx)
  with pytest.raises(ValueError, match=rf"acp_jax\.chain.*{sign}"):
    acp_jax.chain(acp_jax.ssgd(), tx)
  # A transform that needs the params' tree is probed at init, jitted too.
  chained = dp.chain(optax.masked(tx, {"w": True}))
  with pytest.raises(ValueError, match=rf"DataParallel\.chain.*{sign}"):
    jax.jit(chained.init)({"w": jnp.ones((4, 4))})


@pytest.mark.parametrize(
    "tx",
    [
        optax.sgd(0.1, momentum=0.9),
        optax.adamw(1e-3, weight_decay=1e-2),
        optax.sgd(optax.linear_schedule(0.0, 0.1, 10)),  # 0 at step 0
        optax.sgd(0.0),
        optax.masked(optax.adam(1e-3), {"w": True}),
    ],
)
def test_finite_non_negative_learning_rates_pass_the_probe(tx):
  dp = acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh())
  dp.chain(tx).init({"w": jnp.ones((4, 4))})
  acp_jax.chain(acp_jax.ssgd(), tx)
