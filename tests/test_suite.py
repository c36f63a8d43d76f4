"""The suite every compressor joins with one entry in COMPRESSORS."""

import math
from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax import state_trees
from tests import helpers
from tests.conftest import NUM_DEVICES


class Entry(NamedTuple):
  # Keyword arguments common to every factory (bucket_bytes) pass through.
  make: Callable[..., acp_jax.Compressor]
  learning_rate: float  # for the convergence test


COMPRESSORS = {
    "ssgd": Entry(acp_jax.ssgd, 0.1),
    "ssgd_bf16": Entry(
        lambda **kw: acp_jax.ssgd(comm_dtype=jnp.bfloat16, **kw), 0.1
    ),
    "sign_sgd": Entry(acp_jax.sign_sgd, 0.1),
    "sign_sgd_vote": Entry(
        lambda **kw: acp_jax.sign_sgd(majority_vote=True, **kw), 0.003
    ),
    "topk_sgd": Entry(lambda **kw: acp_jax.topk_sgd(0.2, **kw), 0.1),
    "power_sgd": Entry(lambda **kw: acp_jax.power_sgd(2, **kw), 0.1),
    "acp_sgd": Entry(lambda **kw: acp_jax.acp_sgd(2, **kw), 0.1),
}
all_compressors = pytest.mark.parametrize(
    "name", list(COMPRESSORS), ids=list(COMPRESSORS)
)
with_residual = pytest.mark.parametrize(
    "name", ["sign_sgd", "topk_sgd", "power_sgd", "acp_sgd"]
)


def run_steps(tx, mapper, steps, params=helpers.MIXED, seed=0):
  """Updates of ``steps`` steps with fresh per-device gradients each step."""
  update = helpers.mapped(tx.update, mapper)
  state = helpers.replicate(tx.init(params))
  grads, updates = [], []
  for step in range(steps):
    g = helpers.random_grads(seed * 1000 + step, params)
    u, state = update(g, state)
    grads.append(g)
    updates.append(u)
  return grads, updates, state


@all_compressors
def test_pmap_and_shard_map_agree(name):
  tx = COMPRESSORS[name].make()
  _, by_pmap, _ = run_steps(tx, "pmap", 4)
  _, by_shard_map, _ = run_steps(tx, "shard_map", 4)
  chex.assert_trees_all_close(
      helpers.to_numpy(by_pmap), helpers.to_numpy(by_shard_map), atol=1e-6
  )


@all_compressors
def test_buckets_change_no_value(name):
  # One leaf per bucket against all leaves in one bucket: the same steps.
  make = COMPRESSORS[name].make
  _, one_each, _ = run_steps(make(bucket_bytes=1), "shard_map", 2)
  _, all_in_one, _ = run_steps(make(bucket_bytes=math.inf), "shard_map", 2)
  chex.assert_trees_all_close(
      helpers.to_numpy(one_each), helpers.to_numpy(all_in_one), atol=1e-6
  )


@all_compressors
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_compiles_once_per_phase(name, mapper):
  tx = COMPRESSORS[name].make()
  phases = len(tx.phases(tx.init(helpers.MIXED)))
  traces = []

  def update(g, s):
    traces.append(s)
    return tx.update(g, s)

  update = helpers.mapped(update, mapper)
  state = helpers.replicate(tx.init(helpers.MIXED))
  for step in range(3 * phases):
    if step == phases:  # each phase has run once
      traces.clear()
    _, state = update(helpers.random_grads(step, helpers.MIXED), state)
  assert not traces


@all_compressors
def test_replicas_stay_bitwise_identical(name):
  _, updates, _ = run_steps(COMPRESSORS[name].make(), "shard_map", 20)
  for u in helpers.to_numpy(updates):
    chex.assert_trees_all_equal(
        *(jax.tree.map(lambda x: x[d], u) for d in range(NUM_DEVICES))
    )


@all_compressors
def test_updates_keep_low_precision_dtypes(name):
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), helpers.MIXED)
  params["dense"]["kernel"] = params["dense"]["kernel"].astype(jnp.float16)
  _, updates, _ = run_steps(COMPRESSORS[name].make(), "pmap", 2, params)
  for u in updates:
    for x, p in zip(jax.tree.leaves(u), jax.tree.leaves(params)):
      assert x.dtype == p.dtype
      assert np.all(np.isfinite(np.asarray(x, np.float32)))


@all_compressors
def test_large_float16_gradients_stay_finite(name):
  """Entries near 3 on a 512 x 512 float16 leaf: any product that squares
  the gradient's scale (M Q, with a warm-start Q that carries it) overflows."""
  params = {"w": jnp.zeros((512, 512), jnp.float16)}
  tx = COMPRESSORS[name].make()
  update = helpers.mapped(tx.update, "shard_map")
  state = helpers.replicate(tx.init(params))
  rng = np.random.default_rng(0)
  for _ in range(3):
    g = 3 + 0.1 * rng.standard_normal((NUM_DEVICES, 512, 512))
    u, state = update(helpers.shard({"w": g.astype(np.float16)}), state)
    assert np.all(np.isfinite(np.asarray(u["w"], np.float32)))


@all_compressors
def test_zero_size_leaves_pass_through(name):
  """An empty leaf comes back empty and changes nothing for the others."""
  tx = COMPRESSORS[name].make()
  with_empty = {**helpers.MIXED, "empty": jnp.zeros((0, 4))}
  _, updates, _ = run_steps(tx, "shard_map", 2, with_empty)
  _, expected, _ = run_steps(tx, "shard_map", 2)
  for u, e in zip(helpers.to_numpy(updates), helpers.to_numpy(expected)):
    assert u.pop("empty").shape == (NUM_DEVICES, 0, 4)
    chex.assert_trees_all_equal(u, e)


@with_residual
def test_error_feedback_loses_nothing(name):
  """sum of applied updates + mean residual = sum of mean gradients."""
  grads, updates, state = run_steps(COMPRESSORS[name].make(), "pmap", 10)
  residuals = state_trees.state_leaves(state.error)
  sent_dense = [state_trees.is_masked(e) for e in residuals]
  mean_residuals = [
      0.0 if d else e.mean(0) for e, d in zip(residuals, sent_dense)
  ]
  applied = [sum(u) for u in zip(*(jax.tree.leaves(u) for u in updates))]
  mean_grads = [sum(g) for g in zip(*(jax.tree.leaves(g) for g in grads))]
  for a, e, g in zip(applied, mean_residuals, mean_grads):
    np.testing.assert_allclose(a[0] + e, g.mean(0), atol=1e-4)
  # Something was left behind, so the invariant was put to the test.
  assert (
      max(float(jnp.abs(e).max()) for e in jax.tree.leaves(state.error)) > 0.1
  )


@all_compressors
def test_converges_on_least_squares(name):
  """Each device fits its own shard of a linear regression to a common W."""
  entry = COMPRESSORS[name]
  rng = np.random.default_rng(42)
  w_true = rng.standard_normal((16, 12), np.float32) / 4
  x = rng.standard_normal((NUM_DEVICES, 32, 16), np.float32)
  y = x @ w_true + 0.01 * rng.standard_normal((NUM_DEVICES, 32, 12), np.float32)
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}
  tx = optax.chain(entry.make(), optax.sgd(entry.learning_rate))

  def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  def step(p, s, x, y):
    g = jax.grad(loss)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = helpers.per_device(step)
  p, s = helpers.replicate(params), helpers.replicate(tx.init(params))
  initial = float(loss(params, x.reshape(-1, 16), y.reshape(-1, 12)))
  for _ in range(150):
    p, s = step(p, s, x, y)
  final = float(
      loss(
          jax.tree.map(lambda a: np.asarray(a)[0], p),
          x.reshape(-1, 16),
          y.reshape(-1, 12),
      )
  )
  assert final < 0.05 * initial, (initial, final)
