"""Mistakes in a user's loop around a compressor that the library catches:
each trains what the same loop trains without compression, or is refused
with the fix."""

import re
import warnings

import chex
import jax
from jax import lax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from tests import helpers
from tests.conftest import NUM_DEVICES
from tests.helpers import COMPRESSORS
from tests.helpers import mlp_loss

STEPS, BAD = 8, 3
XS, YS, PARAMS = helpers.mlp_problem(STEPS)
# ACP-SGD's phase is a shape: after a skipped step it still advances.
EXACT = sorted(set(COMPRESSORS) - {"acp_sgd"})


def train(dp, tx, batches):
  """Params and compressor states after each of ``batches``, in a jitted
  loop on ``dp.chain(tx)``."""
  tx = dp.chain(tx)
  params = jax.device_put(PARAMS, NamedSharding(dp.mesh, P()))
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    _, grads = dp.value_and_grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for x, y in batches:
    batch = jax.device_put((x, y), NamedSharding(dp.mesh, dp.device_spec))
    params, state = jax.block_until_ready(step(params, state, *batch))
    history.append((helpers.to_numpy(params), helpers.to_numpy(state.comm)))
  return history


def batches(bad):
  """The steps' batches; with ``bad``, step BAD's has an inf in one row of
  device 1's shard, else step BAD is left out."""
  out = []
  for i in range(STEPS):
    x = XS[i].copy()
    if i == BAD:
      if not bad:
        continue
      x[5] = np.inf
    out.append((x, YS[i]))
  return out


def dp_of(name, **kwargs):
  return acp_jax.DataParallel(COMPRESSORS[name](), helpers.mesh(), **kwargs)


def final_loss(params):
  return float(mlp_loss(params, XS.reshape(-1, 12), YS.ravel()))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_a_nonfinite_batch_leaves_the_compressor_as_it_was(name):
  """An inf batch stayed in the residuals: apply_if_finite, then NaN."""
  tx = optax.apply_if_finite(optax.adam(1e-2), 4)
  reference = train(dp_of(name), tx, batches(bad=False))
  got = train(dp_of(name), tx, batches(bad=True))
  # The skipped step left every array of the compressor's state as it was,
  # on every device.
  before, at = got[BAD - 1][1], got[BAD][1]
  chex.assert_trees_all_equal(
      jax.tree.map(lambda a, b: a if a.shape != b.shape else b, at, before),
      at,
  )
  if name in EXACT:
    chex.assert_trees_all_equal(got[BAD + 1 :], reference[BAD:])
  else:
    assert np.isfinite(final_loss(got[-1][0]))
    assert abs(final_loss(got[-1][0]) / final_loss(reference[-1][0]) - 1) < 0.02


@pytest.mark.parametrize("name", EXACT)
def test_skip_needs_no_apply_if_finite(name):
  """No library-level skip of a non-finite step: Adam took the inf."""
  tx = optax.adam(1e-2)
  reference = train(dp_of(name, nonfinite="skip"), tx, batches(bad=False))
  got = train(dp_of(name, nonfinite="skip"), tx, batches(bad=True))
  chex.assert_trees_all_equal(got[BAD][0], got[BAD - 1][0])
  chex.assert_trees_all_equal(got[BAD + 1 :], reference[BAD:])


@pytest.mark.parametrize("name", ["ssgd", "power_sgd"])
def test_a_nonfinite_batch_is_skipped_on_every_node_when_hierarchical(name):
  """Hierarchical: one device's inf, seen by all through the chunks."""
  auto = jax.sharding.AxisType.Auto
  nodes = jax.make_mesh(
      (2, NUM_DEVICES // 2), ("data", "local"), axis_types=(auto, auto)
  )
  dp = lambda: acp_jax.DataParallel(
      COMPRESSORS[name](), nodes, local_axis="local", nonfinite="skip"
  )
  reference = train(dp(), optax.adam(1e-2), batches(bad=False))
  got = train(dp(), optax.adam(1e-2), batches(bad=True))
  chex.assert_trees_all_equal(got[BAD + 1 :], reference[BAD:])


def test_propagate_is_todays_poisoning():
  """nonfinite='propagate' keeps no state: the residuals take the inf."""
  tx = optax.apply_if_finite(optax.adam(1e-2), 4)
  got = train(dp_of("power_sgd", nonfinite="propagate"), tx, batches(bad=True))
  assert not np.isfinite(got[BAD][1].error["w1"]).all()
  with pytest.raises(ValueError, match="nonfinite must be one of 'keep'"):
    dp_of("ssgd", nonfinite="ignore")


def _pmap_step(tx, before=lambda g: g):
  def step(params, state, x, y):
    grads = before(jax.grad(mlp_loss)(params, x, y))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.pmap(step, axis_name="data")


def _pmap_train(tx, steps, before=lambda g: g):
  params = jax.tree.map(lambda a: np.stack([a] * NUM_DEVICES), PARAMS)
  state = jax.pmap(tx.init, axis_name="data")(params)
  step = _pmap_step(tx, before)
  for i in range(steps):
    params, state = step(
        params,
        state,
        XS[i].reshape(NUM_DEVICES, -1, 12),
        YS[i].reshape(NUM_DEVICES, -1),
    )
  return jax.tree.map(lambda a: np.asarray(a[0]), params)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_a_compressor_after_another_transform_is_refused_under_pmap(
    name, monkeypatch
):
  """optax.chain(optax.adam(1e-2), compressor) ran Adam per device, with
  nothing said: acp_jax.chain refuses another transform first; a compressor
  that acp_jax.chain does not run warns under pmap, and with the placement
  debug flag it is refused."""
  with pytest.raises(TypeError, match="acp_jax.chain takes a compressor"):
    acp_jax.chain(optax.adam(1e-2), COMPRESSORS[name]())
  with pytest.raises(ValueError, match="transform 1 is a compressor too"):
    acp_jax.chain(COMPRESSORS[name](), COMPRESSORS[name]())
  with pytest.warns(
      acp_jax.PlacementWarning, match=r"outside acp_jax.chain.*jax.pmap"
  ):
    _pmap_train(optax.chain(optax.adam(1e-2), COMPRESSORS[name]()), 1)
  with warnings.catch_warnings():
    warnings.simplefilter("error", acp_jax.PlacementWarning)
    _pmap_train(acp_jax.chain(COMPRESSORS[name](), optax.adam(1e-2)), 1)
  monkeypatch.setenv("ACP_JAX_DEBUG_PLACEMENT", "1")
  with pytest.raises(ValueError, match="outside acp_jax.chain.*first"):
    _pmap_train(optax.chain(optax.adam(1e-2), COMPRESSORS[name]()), 1)
  named = optax.named_chain(
      ("adam", optax.adam(1e-2)), ("comm", COMPRESSORS[name]())
  )
  with pytest.raises(ValueError, match="outside acp_jax.chain"):
    _pmap_train(named, 1)


@pytest.mark.parametrize("debug", ["0", "1"])
def test_the_compressor_first_trains_as_dense(debug, monkeypatch):
  """acp_jax.chain (with or without the debug flag) and a nested optax
  chain with the compressor first train as the loop without compression."""
  monkeypatch.setenv("ACP_JAX_DEBUG_PLACEMENT", debug)
  dense = _pmap_train(
      optax.adam(1e-2), 3, before=lambda g: lax.pmean(g, "data")
  )
  got = _pmap_train(
      acp_jax.chain(acp_jax.ssgd(), optax.identity(), optax.adam(1e-2)), 3
  )
  chex.assert_trees_all_close(got, dense, rtol=1e-6, atol=1e-7)
  if debug == "0":
    nested = optax.chain(
        optax.chain(acp_jax.ssgd(), optax.identity()), optax.adam(1e-2)
    )
    chex.assert_trees_all_close(
        _pmap_train(nested, 3), dense, rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_gradients_averaged_before_the_compressor_raise_when_debugging(
    name, monkeypatch
):
  """Gradients pmean-ed under pmap were sent dense, then compressed: JAX
  tracks no varying axes there, so the debug flag checks when it runs."""
  monkeypatch.setenv("ACP_JAX_DEBUG_PLACEMENT", "1")
  tx = acp_jax.chain(COMPRESSORS[name](), optax.sgd(0.1))
  with pytest.raises(Exception, match="same on every device of axis 'data'"):
    _pmap_train(tx, 1, before=lambda g: lax.pmean(g, "data"))
  _pmap_train(tx, 1)


def test_power_sgd_state_says_its_next_phase():
  """PowerSgdState lacked the next_phase that AcpSgdState has."""
  tx = acp_jax.power_sgd(2, warmup_steps=1)
  assert tx.init(PARAMS).next_phase is acp_jax.Phase.DENSE
  assert acp_jax.power_sgd(2).init(PARAMS).next_phase is acp_jax.Phase.P


def test_comm_bytes_warns_of_params_sharded_over_another_axis():
  """A model axis added all-gathers that comm_bytes silently missed."""
  auto = jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
  dp = acp_jax.DataParallel(acp_jax.acp_sgd(2), mesh)
  w1 = jax.device_put(PARAMS["w1"], NamedSharding(mesh, P(None, "model")))
  message = re.escape("['w1'] is sharded over mesh axis 'model'")
  with pytest.warns(UserWarning, match=message):
    dp.comm_bytes(dict(PARAMS, w1=w1))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dp.comm_bytes(jax.device_put(PARAMS, NamedSharding(mesh, P())))
