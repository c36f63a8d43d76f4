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
