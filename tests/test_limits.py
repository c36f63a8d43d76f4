"""Limit cases where a compressor must return the exact mean gradient."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import acp_jax
from tests import helpers
from tests.test_suite import run_steps


def assert_exact_mean_every_step(tx, params, steps):
  grads, updates, _ = run_steps(tx, "shard_map", steps, params)
  for g, u in zip(helpers.to_numpy(grads), helpers.to_numpy(updates)):
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[0], u),
        jax.tree.map(lambda x: x.mean(0), g),
        rtol=1e-5,
        atol=1e-5,
    )


def test_ssgd_is_the_mean():
  assert_exact_mean_every_step(acp_jax.ssgd(), helpers.MIXED, 2)


def test_topk_at_density_one_is_the_mean():
  assert_exact_mean_every_step(acp_jax.topk_sgd(1.0), helpers.MIXED, 3)


@pytest.mark.parametrize(
    "shape, rank",
    # From rank 16 the residual reads back the update instead of recomputing
    # the product (``projection.residual``).
    [((6, 10), 10), ((10, 6), 10), ((2, 3, 8), 10), ((16, 40), 16)],
)
def test_power_sgd_at_full_rank_is_the_mean(shape, rank):
  params = {"w": jnp.zeros(shape)}
  tx = acp_jax.power_sgd(rank, min_compression_rate=0)
  assert_exact_mean_every_step(tx, params, 5)


def test_acp_sgd_at_full_rank_on_square_matrices_is_the_mean():
  params = {"w": jnp.zeros((8, 8)), "conv": jnp.zeros((2, 2, 3, 12))}
  tx = acp_jax.acp_sgd(12, min_compression_rate=0)
  assert_exact_mean_every_step(tx, params, 6)  # three P-steps, three Q-steps


def test_acp_pair_of_steps_at_full_rank_of_the_rows_is_exact():
  """Rank n on an n x m matrix (n < m): the Q-step's P' is square orthogonal,
  so it sends all that is left and a P-step plus a Q-step deliver the sum of
  their two mean gradients, leaving no residual."""
  tx = acp_jax.acp_sgd(4, min_compression_rate=0)
  params = {"w": jnp.zeros((4, 9))}
  _, _, after_p = run_steps(tx, "shard_map", 1, params)
  grads, updates, after_q = run_steps(tx, "shard_map", 2, params)
  assert np.abs(np.asarray(after_p.error["w"])).max() > 0.1
  np.testing.assert_allclose(after_q.error["w"], 0, atol=1e-5)
  np.testing.assert_allclose(
      updates[0]["w"][0] + updates[1]["w"][0],
      grads[0]["w"].mean(0) + grads[1]["w"].mean(0),
      atol=1e-5,
  )


def test_keep_dense_sends_chosen_leaves_exactly():
  def keep_dense(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "dense" in jax.tree_util.keystr(path), params
    )

  tx = acp_jax.acp_sgd(2, keep_dense=keep_dense)
  grads, updates, _ = run_steps(tx, "pmap", 2)
  for g, u in zip(grads, updates):
    np.testing.assert_allclose(
        u["dense"]["kernel"][0], g["dense"]["kernel"].mean(0), atol=1e-6
    )
    assert not np.allclose(
        u["conv"]["kernel"][0], g["conv"]["kernel"].mean(0), atol=1e-2
    )
  kernel_bytes = 16 * 12 * 4
  compressed = acp_jax.comm_bytes(
      acp_jax.acp_sgd(2), helpers.MIXED, num_devices=8
  )
  dense = acp_jax.comm_bytes(tx, helpers.MIXED, num_devices=8)
  assert dense["p"].all_reduce == (
      compressed["p"].all_reduce - 16 * 2 * 4 + kernel_bytes
  )


def test_power_sgd_recovers_a_low_rank_gradient_at_once():
  """A gradient of rank <= r, the same on every device, is sent exactly."""
  u, v = np.random.default_rng(0).standard_normal((2, 20, 2), np.float32)
  g = u @ v.T
  tx = acp_jax.power_sgd(2)
  state = helpers.replicate(tx.init({"w": g}))
  update, _ = helpers.mapped(tx.update, "pmap")(
      helpers.replicate({"w": g}), state
  )
  np.testing.assert_allclose(update["w"][0], g, rtol=1e-4, atol=1e-5)
