"""The options Power-SGD users know: error feedback, warm start and the
dtype the factors travel in, for ``power_sgd`` and ``acp_sgd``."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import acp_jax
from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES

LOW_RANK = {"power_sgd": acp_jax.power_sgd, "acp_sgd": acp_jax.acp_sgd}
# Compressed leaves only, so that every byte sent is a factor's.
MATRICES = {
    "a": jnp.zeros((64, 32), jnp.float32),
    "b": jnp.zeros((3, 3, 8, 16), jnp.float32),
}


def exchange(tx, params):
  """``(compress, comm)``: the jitted exchange over the simulated devices
  and the initial state."""
  dp = acp_jax.DataParallel(tx, helpers.mesh())
  return jax.jit(dp.compress), dp.init_comm(params)


def dense_mean(grads):
  return jax.tree.map(lambda g: np.asarray(g).mean(0), grads)


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_full_rank_without_error_feedback_is_the_exact_mean(name):
  """Square leaves at full rank: every step projects on a whole basis."""
  params = {"w": jnp.zeros((5, 5)), "v": jnp.zeros((7, 7))}
  tx = LOW_RANK[name](
      7, min_compression_rate=0.0, use_error_feedback=False
  )
  compress, comm = exchange(tx, params)
  assert jax.tree.leaves(comm.error) == []  # no residual is stored
  for seed in range(3):  # ACP-SGD: P, Q and P again
    grads = helpers.random_grads(seed, params)
    mean, comm = compress(grads, comm)
    chex.assert_trees_all_close(mean, dense_mean(grads), rtol=1e-4, atol=1e-5)
    assert jax.tree.leaves(comm.error) == []


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_error_feedback_changes_only_what_follows_the_first_step(name):
  grads = [helpers.random_grads(seed, MATRICES) for seed in range(2)]
  out = {}
  for feedback in (True, False):
    compress, comm = exchange(
        LOW_RANK[name](2, use_error_feedback=feedback), MATRICES
    )
    first, comm = compress(grads[0], comm)
    second, _ = compress(grads[1], comm)
    out[feedback] = helpers.to_numpy((first, second))
  chex.assert_trees_all_equal(out[True][0], out[False][0])
  assert not np.allclose(out[True][1]["a"], out[False][1]["a"], atol=1e-6)


def _decaying_spectrum_grads():
  """Device gradients whose mean has singular values 1, 0.9, 0.81, ..."""
  rng = np.random.default_rng(0)
  u, _ = np.linalg.qr(rng.standard_normal((64, 32)))
  v, _ = np.linalg.qr(rng.standard_normal((32, 32)))
  mean = (u * 0.9 ** np.arange(32)) @ v.T
  noise = rng.standard_normal((NUM_DEVICES, 64, 32)) * 0.01
  noise -= noise.mean(0)
  return helpers.shard({"w": (mean + noise).astype(np.float32)}), mean


def test_warm_start_converges_on_a_fixed_gradient_and_a_fresh_q_does_not():
  """Power-SGD with warm start is power iteration across steps: on the
  same gradient its rank-2 approximation nears the best one; a fresh random
  Q every step stays one iteration away from it."""
  grads, mean = _decaying_spectrum_grads()
  s = np.linalg.svd(mean, compute_uv=False)
  best = np.sqrt((s[2:] ** 2).sum())
  errors = {}
  for warm_start in (True, False):
    compress, comm = exchange(
        acp_jax.power_sgd(2, use_error_feedback=False, warm_start=warm_start),
        {"w": jnp.zeros((64, 32))},
    )
    for _ in range(8):
      out, comm = compress(grads, comm)
    errors[warm_start] = np.linalg.norm(np.asarray(out["w"]) - mean)
  assert errors[True] < 1.02 * best
  assert errors[False] > 1.08 * best


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_fresh_factors_are_the_same_on_every_replica(name):
  """Without warm start the random Q is drawn on each device from the seed
  and the step count: the replicas must agree, or their means would too
  differ (``compress`` returns only one device's)."""
  tx = LOW_RANK[name](2, warm_start=False)
  params = MATRICES
  update = helpers.per_device(lambda g, s: tx.update(g, s))
  state = helpers.replicate(tx.init(params))
  for seed in range(3):
    mean, state = update(helpers.random_grads(seed, params), state)
    for leaf in jax.tree.leaves(mean):
      leaf = np.asarray(leaf)
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


@pytest.mark.parametrize("name", sorted(LOW_RANK))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_factors_send_half_the_bytes_in_accounting_and_hlo(
    name, dtype
):
  tx32, tx16 = LOW_RANK[name](2), LOW_RANK[name](2, comm_dtype=dtype)
  n = NUM_DEVICES
  full = acp_jax.comm_bytes(tx32, MATRICES, num_devices=n)
  half = acp_jax.comm_bytes(tx16, MATRICES, num_devices=n)
  for phase, state in helpers.phase_states(tx16, MATRICES).items():
    assert 2 * half[phase].total == full[phase].total
    text = helpers.compiled_update(
        tx16, MATRICES, state, compiler_options=helpers.ONE_BY_ONE
    ).as_text()
    hlo_bytes = sum(
        s.bytes for s in hlo.collective_stats(text).values()
    )
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
      # XLA:CPU has no bf16 reduction: it widens the all-reduce to f32
      # (its reducer is renamed "..._promoted") and converts back, so here
      # the bytes are fp32's; XLA:GPU and NCCL reduce bf16 natively.
      assert "_promoted" in text
      assert hlo_bytes == full[phase].total, phase
    else:
      assert hlo_bytes == half[phase].total, phase


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_bf16_factors_train_close_to_fp32_and_keep_residuals_in_fp32(name):
  means = {}
  for dtype in (None, jnp.bfloat16):
    compress, comm = exchange(LOW_RANK[name](4, comm_dtype=dtype), MATRICES)
    for seed in range(4):
      mean, comm = compress(helpers.random_grads(seed, MATRICES), comm)
    means[dtype] = helpers.to_numpy(mean)
    for leaf in jax.tree.leaves((mean, comm.error)):
      assert leaf.dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(means[None]), jax.tree.leaves(means[jnp.bfloat16])):
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert rel < 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"use_error_feedback": 1}, "use_error_feedback must be a bool, got 1"),
        ({"warm_start": None}, "warm_start must be a bool, got None"),
        ({"warmup_factors": "no"}, "warmup_factors must be a bool, got 'no'"),
        ({"comm_dtype": jnp.int8}, "comm_dtype must be a floating dtype"),
    ],
)
@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_bad_options_raise_naming_the_argument(name, kwargs, message):
  with pytest.raises(ValueError, match=message):
    LOW_RANK[name](2, **kwargs)


@pytest.mark.parametrize("factory", [acp_jax.acp_sgd, acp_jax.power_sgd])
def test_options_and_keywords_are_one_set_of_settings(factory):
  options = acp_jax.LowRankOptions(warmup_steps=3, seed=7)
  by_options = factory(4, options=options)
  by_keywords = factory(4, warmup_steps=3, seed=7)
  assert by_options.made_by == by_keywords.made_by
  # A keyword replaces the option's field, and the rest stand.
  both = factory(4, options=options, seed=1)
  assert both.made_by[1]["seed"] == 1 and both.made_by[1]["warmup_steps"] == 3
  with pytest.raises(TypeError, match="'warmup'.*LowRankOptions"):
    factory(4, warmup=3)
  with pytest.raises(TypeError, match="options must be an acp_jax"):
    factory(4, options={"seed": 1})
  with pytest.raises(ValueError, match="min_compression_rate"):
    factory(4, options=acp_jax.LowRankOptions(min_compression_rate=-1))
