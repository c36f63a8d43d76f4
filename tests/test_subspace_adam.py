"""subspace_adam: Adam's moments in the coordinates a low-rank compressor
all-reduces."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax.subspace_adam import carry
from acp_jax.phase import Phase
from tests import helpers
from tests.conftest import NUM_DEVICES
from tests.test_compressed_adam import assert_refused

B1, B2, EPS = 0.9, 0.99, 1e-8
# Two compressed leaves (one a conv kernel, viewed as 36 x 8) and a bias
# sent dense.
PARAMS = {
    "a": jnp.zeros((3, 3, 4, 8)),
    "b": jnp.zeros((20, 16)),
    "bias": jnp.zeros((16,)),
}
WARMUP = 2
STEPS = 6
METHODS = ["acp_sgd", "power_sgd"]


def _make(method, rank=2, warmup=WARMUP, **kwargs):
  return acp_jax.subspace_adam(
      getattr(acp_jax, method)(rank, warmup_steps=warmup, **kwargs),
      b1=B1,
      b2=B2,
      eps=EPS,
  )


def _run(tx, steps=STEPS, state=None, start=0):
  """The directions of ``steps`` steps on random per-device gradients, and
  the last state."""
  dp = acp_jax.DataParallel(tx, helpers.mesh())
  return helpers.run_steps(dp, PARAMS, steps, state, start)


@pytest.mark.parametrize("method", METHODS)
def test_at_full_rank_every_leaf_is_dense_and_it_is_adam(method):
  """At rank min(n, m) a factor is no smaller than its matrix, so every leaf
  goes dense and each step is Adam's on the exact mean gradient. (Adam is
  not invariant to a rotation of its coordinates, so a full-rank basis
  other than the identity would not give Adam's step: full rank means the
  standard basis.)"""
  with pytest.warns(UserWarning, match="no matrix leaf is compressed"):
    got, _ = _run(_make(method, rank=36))
  ssgd = jax.jit(acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh()).compress)
  adam = optax.scale_by_adam(B1, B2, EPS)
  state = adam.init(PARAMS)
  for step in range(STEPS):
    mean, _ = ssgd(helpers.random_grads(step, PARAMS), optax.EmptyState())
    expected, state = adam.update(mean, state)
    for a, b in zip(jax.tree.leaves(got[step]), jax.tree.leaves(expected)):
      np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)


N, M, R = 7, 5, 2


def _to_full(side, basis):
  """(n*m, coords) matrix: the n x m moment from coordinates on ``basis``."""
  if side is Phase.P:  # coords n x r: full = C B^T
    # d full[i, j] / d C[a, k] = [i == a] B[j, k]
    t = np.einsum("ia,jk->ijak", np.eye(N), basis)
  else:  # coords r x m: full = B C
    # d full[i, j] / d C[k, b] = B[i, k] [j == b]
    t = np.einsum("ik,jb->ijkb", basis, np.eye(M))
  return t.reshape(N * M, -1)


def _from_full(side, basis):
  """(coords, n*m) matrix: the coordinates of an n x m matrix projected on
  ``basis``."""
  return _to_full(side, basis).T  # orthonormal bases: the adjoint


@pytest.mark.parametrize(
    "old_side,new_side",
    [(Phase.Q, Phase.P), (Phase.P, Phase.Q), (Phase.Q, Phase.Q)],
)
def test_a_change_of_basis_carries_the_moments_as_ldadams_rule(
    old_side, new_side
):
  rng = np.random.default_rng(0)
  basis = lambda side: np.linalg.qr(
      rng.standard_normal((M if side is Phase.P else N, R))
  )[0]
  shape = lambda side: (N, R) if side is Phase.P else (R, M)
  old_basis, new_basis = basis(old_side), basis(new_side)
  mu = rng.standard_normal(shape(old_side))
  nu = np.square(mu) + rng.uniform(0.1, 1.0, shape(old_side))
  count = 5
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  carried = lambda side, b: carry(
      (old_side, f32(old_basis), f32(mu), f32(nu)),
      (side, f32(b)),
      jnp.asarray(count, jnp.int32),
      B1,
      B2,
  )
  got = carried(new_side, new_basis)
  # The change of coordinates as one explicit linear map A: mu' = A mu;
  # the variance, coordinates independent, goes through A squared.
  a = _from_full(new_side, new_basis) @ _to_full(old_side, old_basis)
  c1, c2 = 1 - B1**count, 1 - B2**count
  variance = nu / c2 - np.square(mu / c1)
  new_mu = a @ mu.ravel()
  new_nu = np.abs(np.square(a) @ variance.ravel() + np.square(new_mu / c1))
  new_nu *= c2
  full_old = (_to_full(old_side, old_basis) @ mu.ravel()).reshape(N, M)
  full_new = (_to_full(new_side, new_basis) @ new_mu).reshape(N, M)
  np.testing.assert_allclose(got[0].ravel(), new_mu, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[1].ravel(), new_nu, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[2], full_old - full_new, rtol=1e-4, atol=1e-5)
  # On the same basis nothing changes and nothing is lost.
  same = carried(old_side, old_basis)
  np.testing.assert_allclose(same[0], mu, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(same[1], nu, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(same[2], 0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_each_step_is_adam_on_the_coordinates_it_sent(method):
  """The direction is the basis times Adam's step on the moments the state
  keeps, and lies in that basis's span."""
  directions, state = _run(_make(method), steps=WARMUP + 3)
  side = "on_p" if method == "acp_sgd" else "on_q"  # ACP's last: a P-step
  moments = getattr(state, side)
  t = int(state.dense.count)
  assert t == WARMUP + 3
  for leaf in ("a", "b"):
    mu, nu, basis = (np.asarray(getattr(moments, f)[leaf]) for f in
                     ("mu", "nu", "basis"))
    step = (mu / (1 - B1**t)) / (np.sqrt(nu / (1 - B2**t)) + EPS)
    expected = step @ basis.T if side == "on_p" else basis @ step
    np.testing.assert_allclose(
        directions[-1][leaf].reshape(expected.shape), expected, rtol=1e-4,
        atol=1e-6,
    )
    np.testing.assert_allclose(basis.T @ basis, np.eye(2), atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_the_moments_are_bitwise_identical_on_every_device(method):
  _, state = _run(_make(method))
  residuals = np.asarray(state.local[0]["b"])
  assert residuals.shape == (NUM_DEVICES, 20, 16)
  assert not np.array_equal(residuals[0], residuals[1])  # per device
  replicated = jax.tree.leaves(state._replace(local=()))
  assert len(replicated) > 10
  for x in replicated:
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    assert len(shards) == NUM_DEVICES
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


def test_checkpoint_resume_is_bitwise(tmp_path):
  helpers.assert_resume_is_bitwise(
      lambda: acp_jax.DataParallel(_make("acp_sgd"), helpers.mesh()),
      PARAMS,
      tmp_path / "ckpt",
      STEPS,
      stop=3,  # through the switch, into phase Q
  )


def test_the_moments_loss_goes_to_the_residual_only_with_feedback():
  with_fb, state_fb = _run(_make("acp_sgd"), steps=WARMUP + 2)
  without = acp_jax.subspace_adam(
      acp_jax.acp_sgd(2, warmup_steps=WARMUP), b1=B1, b2=B2, eps=EPS,
      moment_feedback=False,
  )
  plain, state = _run(without, steps=WARMUP + 2)
  # The same until the first change of basis after the moments exist.
  np.testing.assert_array_equal(with_fb[0]["b"], plain[0]["b"])
  assert not np.array_equal(
      np.asarray(state_fb.local[0]["b"]), np.asarray(state.local[0]["b"])
  )


def test_misuse_is_refused():
  with pytest.raises(ValueError, match="sign_sgd"):
    acp_jax.subspace_adam(acp_jax.sign_sgd())
  with pytest.raises(ValueError, match="ssgd"):
    acp_jax.subspace_adam(acp_jax.ssgd())
  with pytest.raises(ValueError, match="b2 must be in"):
    acp_jax.subspace_adam(acp_jax.acp_sgd(2), b2=1.0)
  with pytest.raises(ValueError, match="eps must be"):
    acp_jax.subspace_adam(acp_jax.acp_sgd(2), eps=-1.0)
  with pytest.raises(ValueError, match="moment_feedback must be a bool"):
    acp_jax.subspace_adam(acp_jax.acp_sgd(2), moment_feedback=1)
  with pytest.raises(TypeError, match="made by acp_jax"):
    acp_jax.subspace_adam(optax.adam(0.1))
  dp = acp_jax.DataParallel(_make("acp_sgd"), helpers.mesh())
  with pytest.raises(ValueError, match="subspace_adam.*Adam's direction"):
    dp.chain(optax.adamw(1e-3)).init(PARAMS)


@pytest.mark.parametrize(
    "compressor, changes, match",
    [
        ("acp_sgd", {"optimizer.name": "sgd"}, "config.optimizer.name='sgd'"),
        ("sign_sgd", {}, "subspace_adam.*sign_sgd"),
    ],
)
def test_the_trainer_refuses_it_without_adamw_or_a_low_rank_compressor(
    compressor, changes, match
):
  assert_refused(compressor, "subspace_adam", changes, match)


@pytest.mark.parametrize("method", METHODS)
def test_with_track_momentum_the_next_basis_is_the_moments(method):
  tx = acp_jax.subspace_adam(
      getattr(acp_jax, method)(2, warmup_steps=WARMUP), b1=B1, b2=B2,
      eps=EPS, track_momentum=True,
  )
  _, state = _run(tx, steps=WARMUP + 1)  # the last: a P-step, or Power's
  if method == "acp_sgd":
    factor, moment = state.inner.p["b"], state.on_p.mu["b"]
  else:
    factor, moment = state.inner.q["b"], state.on_q.mu["b"].T
  np.testing.assert_array_equal(np.asarray(factor), np.asarray(moment))
  _, plain = _run(_make(method), steps=WARMUP + 1)
  factor = plain.inner.p["b"] if method == "acp_sgd" else plain.inner.q["b"]
  assert not np.allclose(np.asarray(factor), np.asarray(moment))


def test_match_rms_scales_each_step_by_the_root_of_the_reduced_dimension():
  plain, _ = _run(_make("power_sgd", warmup=0), steps=2)
  scaled, _ = _run(
      acp_jax.subspace_adam(
          acp_jax.power_sgd(2), b1=B1, b2=B2, eps=EPS, match_rms=True
      ),
      steps=2,
  )
  # Power-SGD's basis is n x r: a conv kernel of 36 rows, a 20 x 16 matrix.
  for leaf, n in (("a", 36), ("b", 20)):
    np.testing.assert_allclose(
        scaled[-1][leaf], plain[-1][leaf] * np.sqrt(n / 2), rtol=1e-4
    )
  np.testing.assert_array_equal(scaled[-1]["bias"], plain[-1]["bias"])


def test_in_a_users_loop_it_trains_and_at_full_rank_is_adamw():
  """A plain jitted optax loop on dp.chain, against the same loop with
  optax.adamw on the whole batch (the dense reference)."""
  from tests import test_user_loops_compressor as loops

  decay = optax.chain(
      optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-2)
  )
  steps = loops.batches(bad=False)

  def run(compressor, tx):
    dp = acp_jax.DataParallel(compressor, helpers.mesh())
    return [p for p, _ in loops.train(dp, tx, steps)]

  adamw = optax.adamw(1e-2, b1=B1, b2=B2, eps=EPS, weight_decay=1e-4)
  dense = run(acp_jax.ssgd(), adamw)
  with pytest.warns(UserWarning, match="no matrix leaf is compressed"):
    full = run(
        acp_jax.subspace_adam(acp_jax.acp_sgd(32), b1=B1, b2=B2, eps=EPS),
        decay,
    )
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(dense)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  low = run(acp_jax.subspace_adam(acp_jax.acp_sgd(2), b1=B1, b2=B2), decay)
  loss = lambda p: float(loops.mlp_loss(p, loops.XS[0], loops.YS[0]))
  assert loss(low[-1]) < loss(loops.PARAMS)
  assert not np.allclose(low[-1]["w1"], dense[-1]["w1"], rtol=1e-3)
