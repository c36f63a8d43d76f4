"""The direction benchmark: its cosines and its geometry variants."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import adam_geometry
from benchmarks import direction


@pytest.fixture
def text(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "text.txt"
  path.write_text("".join(rng.choice(list("abcde fgh\n"), 2000)))
  return str(path)


def _two_steps(text, method, geometries, comm_dtypes=(None,)):
  """Rows by variant of a tiny model measured for 2 steps after 1 dense
  one, at rank 64 (every leaf sent dense) and rank 1."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # nothing compressed
    rows = direction.measure(
        text,
        warmup_steps=1,
        measure_steps=2,
        ranks=(64, 1),
        methods=(method,),
        geometries=geometries,
        comm_dtypes=comm_dtypes,
        tiny=True,
    )
  return {r["variant"]: r for r in rows}


@pytest.mark.slow
def test_cosines_measure_the_compression(text):
  # At a rank as large as every matrix every leaf is sent dense: that
  # variant is S-SGD, so its mean and its Adam update must be S-SGD's. At
  # rank 1 the direction turns.
  by_name = _two_steps(
      text, "power_sgd", (None, "factored"), (None, "bfloat16")
  )
  assert set(by_name) == {
      "power_sgd_r64",
      "power_sgd_r64_factored",
      "power_sgd_r1",
      "power_sgd_r1_factored",
      "power_sgd_r64_bf16",
      "power_sgd_r64_factored_bf16",
      "power_sgd_r1_bf16",
      "power_sgd_r1_factored_bf16",
  }
  # The factors' rounding turns the direction a little, not the rank.
  fp32, bf16 = by_name["power_sgd_r1"], by_name["power_sgd_r1_bf16"]
  assert any(bf16[k] != fp32[k] for k in direction.METRICS)
  for key in direction.METRICS:
    assert bf16[key] == pytest.approx(fp32[key], abs=0.02), key
  for name, row in by_name.items():
    assert row["steps"] == 2
    for key in direction.METRICS:
      if "r64" in name:
        assert row[key] == pytest.approx(1.0, abs=1e-5), (name, key)
      else:
        assert 0.0 < row[key] < 0.999, (name, key)


@pytest.mark.slow
def test_the_compressed_moment_sent_whole_is_the_true_moment(text):
  # At a rank where every leaf goes dense, compressed_adam's mean momentum
  # is the true mean of what the devices hold; at rank 1 it turns.
  by_name = _two_steps(text, "acp_sgd", ("momentum", "momentum_preconditioned"))
  assert set(by_name) == {
      f"acp_sgd_r{r}_{g}"
      for r in (64, 1)
      for g in ("momentum", "momentum_preconditioned")
  }
  for name, row in by_name.items():
    assert row["adam_shared"] is None
    if "r64" in name:
      assert row["grad"] == pytest.approx(1.0, abs=1e-5), name
    else:
      assert 0.0 < row["grad"] < 0.999, name


@pytest.mark.slow
def test_decoupled_momentum_sends_the_momentum_and_adam_follows_it(text):
  # The mean sent is a momentum: at a rank where every leaf goes dense, each
  # device sends its whole b1 m + G_i and keeps nothing, so the mean is the
  # gradient's and its cosine with S-SGD's momentum is below 1; Adam then
  # runs without its own first moment, and has no shared variant.
  by_name = _two_steps(text, "power_sgd", ("decoupled",))
  for name, row in by_name.items():
    assert row["steps"] == 2 and row["adam_shared"] is None
    assert 0.0 < row["grad"] < 0.999 and 0.0 < row["adam"] < 0.999, name


def _update(variant, grads, state):
  axes = variant.device_axes(state)
  run = jax.vmap(
      variant.update, in_axes=(0, axes), out_axes=(None, axes), axis_name="data"
  )
  return run(grads, state)


@pytest.mark.parametrize("geometry", ["factored", "full"])
def test_geometry_keeps_the_unscaled_residual(geometry):
  # The residual the geometry variant stores, divided by its new weights,
  # is M - mean in the gradient's own space: nothing is lost to the scaling.
  n = 4
  params = {"w": jnp.zeros((12, 10))}
  keys = jax.random.split(jax.random.key(1), 3)
  grads = [
      {"w": jax.random.normal(k, (n, 12, 10)) * jnp.arange(1, 11)} for k in keys
  ]
  plain = adam_geometry.Variant("power_sgd", 2, None, 0)
  scaled = adam_geometry.Variant("power_sgd", 2, geometry, 0)
  p_state = plain.init(params)
  s_state = scaled.init(params)
  stack = lambda x: jnp.broadcast_to(x, (n,) + x.shape)
  p_state = p_state._replace(error=jax.tree.map(stack, p_state.error))
  s_state = s_state._replace(
      inner=s_state.inner._replace(
          error=jax.tree.map(stack, s_state.inner.error)
      )
  )
  # Before any mean is seen the weights are ones: the compressor itself.
  p_mean, _ = _update(plain, grads[0], p_state)
  s_mean, s_state = _update(scaled, grads[0], s_state)
  np.testing.assert_array_equal(p_mean["w"], s_mean["w"])
  residual = grads[0]["w"] - s_mean["w"]
  for g in grads[1:]:
    s_mean, s_state = _update(scaled, g, s_state)
    weights = scaled.geometry.weights(s_state.moment[0], s_state.count)
    assert not np.allclose(weights, 1.0)
    residual = residual + g["w"] - s_mean["w"]
    np.testing.assert_allclose(
        s_state.inner.error["w"] / weights, residual, rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_subspace_adam_at_full_rank_is_s_sgds_adam(text):
  # Every leaf dense: subspace_adam is Adam on the exact mean, its update
  # S-SGD's; at rank 1 it turns, and it has no mean of its own to measure.
  by_name = _two_steps(text, "acp_sgd", ("subspace_adam",))
  dense, low = by_name["acp_sgd_r64_subspace_adam"], by_name[
      "acp_sgd_r1_subspace_adam"
  ]
  assert dense["adam"] == pytest.approx(1.0, abs=1e-5)
  assert 0.0 < low["adam"] < 0.999
  assert dense["steps"] == low["steps"] == 2
  assert dense["grad"] is None and dense["adam_shared"] is None


def test_a_factor_cut_keeps_its_leading_subspace_and_a_completed_one_its_own():
  rng = np.random.default_rng(0)
  u, _ = np.linalg.qr(rng.standard_normal((40, 8)))
  src = jnp.asarray(u * 2.0 ** -np.arange(8) @ np.linalg.qr(
      rng.standard_normal((8, 8)))[0], jnp.float32)
  cut = np.asarray(direction._resize(src, jnp.zeros((40, 3))))
  assert cut.shape == (40, 3)
  # Its columns span the three leading left singular directions of src.
  lead = u[:, :3]
  np.testing.assert_allclose(
      lead @ (lead.T @ cut), cut, rtol=1e-4, atol=1e-5
  )
  old = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
  grown = np.asarray(direction._resize(cut, old))
  np.testing.assert_array_equal(grown[:, :3], cut)
  np.testing.assert_array_equal(grown[:, 3:], np.asarray(old)[:, 3:])


def _jumping_grads(step, n=4):
  """Device gradients whose size steps up tenfold at step 25."""
  rng = np.random.default_rng(step)
  scale = 10.0 if step >= 25 else 1.0
  return {
      "w": jnp.asarray(rng.standard_normal((n, 64, 48)) * scale, jnp.float32),
      "v": jnp.asarray(rng.standard_normal((n, 48, 40)) * scale, jnp.float32),
  }


@pytest.mark.parametrize("method", ["acp_sgd", "power_sgd"])
def test_accordion_raises_the_rank_where_the_gradient_jumps(method):
  params = {"w": jnp.zeros((64, 48)), "v": jnp.zeros((48, 40))}
  warmup, interval = 5, direction.ACCORDION_INTERVAL
  run = direction._AccordionRun(method, 4, warmup, params, 4)
  for step in range(warmup + 5 * interval):
    mean = run.step(_jumping_grads(step), step)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(mean))
  by_interval = [
      set(run.history[warmup + i * interval : warmup + (i + 1) * interval])
      for i in range(5)
  ]
  # Twice the rank first; then half of it, with no change measured yet and
  # then with the rank's bytes overspent; twice again after the interval in
  # which the norm jumped (the 3rd, steps 25 to 34), and half once it holds.
  assert by_interval == [{1}, {0}, {0}, {1}, {0}], by_interval
  # The state went on across the changes: one count, the phases in turn.
  state = run.levels[run.active].state
  assert int(state.count) == warmup + 5 * interval
  summary = run.summary()
  assert summary["high_fraction"] == pytest.approx(0.4)
  # Within the rank's bytes but for one interval at twice the rank.
  lo, hi, target = run.bytes
  assert summary["bytes_vs_rank"] == pytest.approx(
      (3 * lo + 2 * hi) / (5 * target)
  )
  assert lo < target < hi


def test_accordion_refuses_ranks_that_compress_different_leaves():
  params = {"w": jnp.zeros((64, 48)), "v": jnp.zeros((12, 10))}
  with pytest.raises(ValueError, match="accordion at rank 4: ranks 2 and 8"):
    direction._AccordionRun("acp_sgd", 4, 1, params, 4)
