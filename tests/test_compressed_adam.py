"""compressed_adam: Adam with its first moment sent through a compressor."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax import checkpoint as acp_checkpoint
from tests import helpers
from tests.conftest import NUM_DEVICES
from tests.test_comm import hlo_volume
from tests.test_train import read_metrics
from tests.test_train import small_config
from train import config as config_lib
from train import train

B1, B2, EPS = 0.9, 0.99, 1e-8
# Two compressed leaves and a bias sent dense. The matrices are square: at
# rank min(n, m), ACP-SGD's Q-step projects on the span of the last P, which
# is the whole space only then.
PARAMS = {
    "a": jnp.zeros((12, 12)),
    "b": jnp.zeros((20, 20)),
    "bias": jnp.zeros((12,)),
}
WARMUP = 2
STEPS = 6


def _data_parallel(compressor, preconditioned=False):
  """The ``DataParallel`` that runs ``compressed_adam(compressor)``."""
  return acp_jax.DataParallel(
      acp_jax.compressed_adam(
          compressor, b1=B1, b2=B2, eps=EPS, preconditioned=preconditioned
      ),
      helpers.mesh(),
  )


def _run(compressor, steps=STEPS, state=None, start=0, preconditioned=False):
  """Adam's directions of ``steps`` steps on random per-device gradients,
  and the last state."""
  dp = _data_parallel(compressor, preconditioned)
  return helpers.run_steps(dp, PARAMS, steps, state, start)


def _frozen_adam(steps, freeze_after):
  """Adam on the exact mean gradients, nu frozen after ``freeze_after``
  steps (never, if None), written out from the update rule."""
  mean = jax.jit(lambda g: jax.tree.map(lambda x: x.mean(0), g))
  mu = nu = jax.tree.map(np.zeros_like, helpers.to_numpy(PARAMS))
  directions = []
  for t in range(1, steps + 1):
    g = helpers.to_numpy(mean(helpers.random_grads(t - 1, PARAMS)))
    mu = jax.tree.map(lambda m, x: B1 * m + (1 - B1) * x, mu, g)
    if freeze_after is None or t <= freeze_after:
      nu = jax.tree.map(lambda v, x: B2 * v + (1 - B2) * x * x, nu, g)
      frozen = t
    directions.append(
        jax.tree.map(
            lambda m, v: (m / (1 - B1**t))
            / (np.sqrt(v / (1 - B2**frozen)) + EPS),
            mu,
            nu,
        )
    )
  return directions


def test_with_ssgd_it_is_adam_bitwise():
  directions, _ = _run(acp_jax.ssgd())
  ssgd = jax.jit(acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh()).compress)
  adam = optax.scale_by_adam(B1, B2, EPS)
  update = jax.jit(adam.update)
  state = adam.init(PARAMS)
  for step, got in enumerate(directions):
    mean, _ = ssgd(helpers.random_grads(step, PARAMS), optax.EmptyState())
    expected, state = update(mean, state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(a, np.asarray(b))


def test_with_ssgd_it_follows_adams_update_rule():
  got, _ = _run(acp_jax.ssgd())
  for step, expected in enumerate(_frozen_adam(STEPS, None)):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        got[step],
        expected,
    )


@pytest.mark.parametrize("preconditioned", [False, True])
@pytest.mark.parametrize("method", ["power_sgd", "acp_sgd"])
def test_at_full_rank_it_is_adam_with_nu_frozen_after_the_warmup(
    method, preconditioned
):
  # Rank 20 is full rank for both matrices; a compression rate below 1 lets
  # them be compressed at all.
  compressor = getattr(acp_jax, method)(
      20, warmup_steps=WARMUP, min_compression_rate=0.1
  )
  got, _ = _run(compressor, preconditioned=preconditioned)
  expected = _frozen_adam(STEPS, WARMUP)
  for step in range(STEPS):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5),
        got[step],
        expected[step],
    )
  # Compressed steps differ from Adam's own (nu not frozen) ones.
  adam = _frozen_adam(STEPS, None)
  assert not np.allclose(got[-1]["b"], adam[-1]["b"], rtol=1e-2)


def test_at_low_rank_the_two_spaces_give_two_directions():
  make = lambda: acp_jax.acp_sgd(2, warmup_steps=WARMUP)
  plain, _ = _run(make())
  scaled, _ = _run(make(), preconditioned=True)
  expected = _frozen_adam(STEPS, WARMUP)
  for got in (plain, scaled):
    np.testing.assert_allclose(got[0]["b"], expected[0]["b"], rtol=1e-4)
    assert not np.allclose(got[-1]["b"], expected[-1]["b"], rtol=1e-2)
    assert all(np.isfinite(x).all() for d in got for x in jax.tree.leaves(d))
  assert not np.allclose(plain[-1]["b"], scaled[-1]["b"], rtol=1e-2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: acp_jax.acp_sgd(4, warmup_steps=WARMUP),
        lambda: acp_jax.power_sgd(4, warmup_steps=WARMUP),
    ],
    ids=["acp_sgd", "power_sgd"],
)
def test_replicated_state_is_bitwise_identical_on_every_device(make):
  _, state = _run(make())
  assert state.local[0]["b"].shape == (NUM_DEVICES, 20, 20)
  residuals = np.asarray(state.local[0]["b"])
  assert not np.array_equal(residuals[0], residuals[1])  # per device
  replicated = jax.tree.leaves(state._replace(local=()))
  assert replicated
  for x in replicated:
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    assert len(shards) == NUM_DEVICES
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


# Both wrappers of acp_jax.wrapped: each sends what its compressor sends.
@pytest.mark.parametrize(
    "wrap", [acp_jax.compressed_adam, acp_jax.subspace_adam]
)
@pytest.mark.parametrize("method", ["power_sgd", "acp_sgd"])
def test_compiled_bytes_equal_the_accounting_and_the_compressors(
    method, wrap
):
  inner = getattr(acp_jax, method)(4, warmup_steps=WARMUP)
  tx = wrap(inner)
  expected = acp_jax.comm_bytes(tx, PARAMS, num_devices=NUM_DEVICES)
  assert expected == acp_jax.comm_bytes(inner, PARAMS, num_devices=NUM_DEVICES)
  states = helpers.phase_states(tx, PARAMS)
  assert set(states) == set(expected)
  for phase, state in states.items():
    assert hlo_volume(tx, PARAMS, state) == expected[phase], phase


def test_checkpoint_resume_is_bitwise(tmp_path):
  helpers.assert_resume_is_bitwise(
      lambda: _data_parallel(acp_jax.acp_sgd(4, warmup_steps=WARMUP)),
      PARAMS,
      tmp_path / "ckpt",
      STEPS,
      stop=3,  # through the switch, into phase Q
  )


def test_a_restore_into_the_bare_compressor_is_refused(tmp_path):
  _, state = _run(acp_jax.acp_sgd(4, warmup_steps=WARMUP), steps=1)
  dp = _data_parallel(acp_jax.acp_sgd(4, warmup_steps=WARMUP))
  acp_checkpoint.save(tmp_path / "ckpt", state, compressor=dp.compressor)
  bare = acp_jax.acp_sgd(4, warmup_steps=WARMUP)
  with pytest.raises(ValueError, match="compressed_adam"):
    acp_checkpoint.restore(tmp_path / "ckpt", state, compressor=bare)


def test_misuse_is_refused():
  with pytest.raises(ValueError, match="warmup_steps=0"):
    acp_jax.compressed_adam(acp_jax.acp_sgd(4))
  with pytest.raises(ValueError, match="sign_sgd"):
    acp_jax.compressed_adam(acp_jax.sign_sgd())
  with pytest.raises(ValueError, match="b1 must be in"):
    acp_jax.compressed_adam(acp_jax.ssgd(), b1=1.0)
  with pytest.raises(ValueError, match="eps must be"):
    acp_jax.compressed_adam(acp_jax.ssgd(), eps=0.0)
  with pytest.raises(ValueError, match="preconditioned must be a bool"):
    acp_jax.compressed_adam(acp_jax.ssgd(), preconditioned="yes")
  with pytest.raises(TypeError, match="made by acp_jax"):
    acp_jax.compressed_adam(optax.sgd(0.1))


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-3),
        optax.chain(optax.clip(1.0), optax.adamw(1e-3)),
        optax.rmsprop(1e-3),
    ],
)
def test_adam_after_it_in_dp_chain_is_refused(tx):
  """It is Adam already: a second preconditioner would rescale its
  direction by its own moments."""
  dp = _data_parallel(acp_jax.ssgd())
  with pytest.raises(ValueError, match="Adam's direction already"):
    dp.chain(tx).init(PARAMS)
  # What follows scale_by_adam in optax.adamw is the spelling it names.
  dp.chain(
      optax.chain(
          optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(1e-3)
      )
  ).init(PARAMS)


# The trainer's option: config.compressor.compress="momentum".


def _adamw_config(compressor, **overrides):
  config = small_config(compressor, steps=4, **overrides)
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.weight_decay = 0.01
  config.optimizer.adamw.update(b1=B1, b2=B2, eps=EPS)
  return config


@pytest.mark.slow
def test_the_trainer_with_ssgd_and_momentum_is_its_adamw_run(tmp_path):
  plain = _adamw_config("ssgd", log_every_steps=1)
  moment = _adamw_config("ssgd", log_every_steps=1)
  moment.compressor.compress = "momentum"
  runs = []
  for name, config in (("plain", plain), ("moment", moment)):
    train.train_and_evaluate(config, str(tmp_path / name))
    runs.append([l["loss"] for l in read_metrics(str(tmp_path / name))[0]])
  assert len(runs[0]) == 4 and runs[0] == runs[1]


def assert_refused(compressor, compress, changes, match):
  """The trainer refuses ``compress`` over ``compressor`` in the AdamW
  config with ``changes`` (by dotted key), by an error matching ``match``."""
  config = _adamw_config(compressor)
  config.compressor.compress = compress
  config.update_from_flattened_dict(changes)
  with pytest.raises(ValueError, match=match):
    config_lib.validate(config, NUM_DEVICES)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"optimizer.name": "sgd"}, "config.optimizer.name='sgd'"),
        (
            {"compressor.acp_sgd.warmup_steps": 0},
            "compress='momentum'.*warmup_steps",
        ),
        ({"compressor.compress": "moment"}, "config.compressor.compress"),
        ({"optimizer.adamw.amsgrad": True}, "config.optimizer.adamw.*amsgrad"),
    ],
)
def test_the_trainer_refuses_momentum_without_adamw_or_a_warmup(
    changes, match
):
  assert_refused("acp_sgd", "momentum", changes, match)
