"""Dense warm-up of the low-rank compressors: S-SGD's steps first, the
factors warmed on the mean gradient, then compression, switched by the host
(``at_step``) with one program per phase."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from acp_jax import checkpoint
from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES
from tests.helpers import mlp_loss

STEPS = 6
XS, YS, PARAMS = helpers.mlp_problem(STEPS)
WARMUP = 3
LOW_RANK = {"power_sgd": acp_jax.power_sgd, "acp_sgd": acp_jax.acp_sgd}


class Run:
  """A user's jitted loop on ``DataParallel(compressor)``, one batch a step."""

  def __init__(self, compressor):
    self.dp = acp_jax.DataParallel(compressor, helpers.mesh())
    self.tx = self.dp.chain(optax.sgd(0.1, momentum=0.9))
    self.params = jax.device_put(PARAMS, NamedSharding(self.dp.mesh, P()))
    self.state = self.tx.init(self.params)
    self.done = 0

    @jax.jit
    def step(params, state, x, y):
      loss, grads = self.dp.value_and_grad(mlp_loss)(params, x, y)
      updates, state = self.tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    self.step = step

  def batch(self, i):
    sharding = NamedSharding(self.dp.mesh, self.dp.device_spec)
    return jax.device_put((XS[i], YS[i]), sharding)

  def run(self, steps):
    """Params after each of the next ``steps`` steps."""
    history = []
    for _ in range(steps):
      self.state = self.dp.at_step(self.state, self.done)
      self.params, self.state, _ = jax.block_until_ready(
          self.step(self.params, self.state, *self.batch(self.done))
      )
      self.done += 1
      history.append(helpers.to_numpy(self.params))
    return history


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_warmup_steps_are_ssgd_bitwise_then_compression_starts(name):
  warm = Run(LOW_RANK[name](2, warmup_steps=WARMUP)).run(STEPS)
  dense = Run(acp_jax.ssgd()).run(STEPS)
  for k in range(WARMUP):
    chex.assert_trees_all_equal(warm[k], dense[k])
  # From the switch on, the low-rank update differs from the dense mean.
  assert not np.allclose(warm[WARMUP]["w1"], dense[WARMUP]["w1"], atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_without_factor_warmup_compression_starts_from_a_fresh_state(name):
  """After the warm-up, the compressor's state is a fresh one's (zero
  residual, the seed's Q, the first compressing phase): the first compressed
  step is what a compressor without warm-up does first. Factor warm-up
  changes Q only."""
  cold = Run(LOW_RANK[name](2, warmup_steps=WARMUP, warmup_factors=False))
  cold.run(WARMUP)
  fresh = Run(LOW_RANK[name](2)).state.comm
  switched = cold.dp.at_step(cold.state, WARMUP).comm
  assert int(switched.count) == WARMUP
  chex.assert_trees_all_equal(switched._replace(count=fresh.count), fresh)
  warm = Run(LOW_RANK[name](2, warmup_steps=WARMUP))
  warm.run(WARMUP)
  warmed = warm.dp.at_step(warm.state, WARMUP).comm
  chex.assert_trees_all_equal(
      warmed._replace(q=fresh.q, count=fresh.count), fresh
  )
  assert not np.allclose(warmed.q["w1"], fresh.q["w1"])


def _rank_one_grads(seed):
  """Device gradients whose mean is rank one, in its own subspace each."""
  rng = np.random.default_rng(seed)
  u, v = rng.standard_normal((64, 1)), rng.standard_normal((1, 48))
  noise = rng.standard_normal((NUM_DEVICES, 64, 48)) * 0.01
  noise -= noise.mean(0)  # the mean is exactly u v
  return {"w": (u @ v + noise).astype(np.float32)}


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_warmed_factors_recover_a_low_rank_mean_at_the_first_compressed_step(
    name,
):
  """ACP-SGD's first P-step projects on Q alone: only a warmed Q spans the
  mean's row space. Power-SGD's step is a whole power iteration, which
  recovers a rank-one mean from any Q."""
  grads = helpers.shard(_rank_one_grads(0))
  mean = np.asarray(grads["w"]).mean(0)

  def first_compressed_error(warmup_factors):
    tx = LOW_RANK[name](1, warmup_steps=1, warmup_factors=warmup_factors)
    dp = acp_jax.DataParallel(tx, helpers.mesh())
    comm = dp.init_comm({"w": jnp.zeros((64, 48))})
    compress = jax.jit(dp.compress)
    _, comm = compress(grads, comm)  # the one dense step
    out, _ = compress(grads, tx.at_step(comm, 1))
    return np.abs(np.asarray(out["w"]) - mean).max() / np.abs(mean).max()

  assert first_compressed_error(True) < 1e-5
  if name == "acp_sgd":
    assert first_compressed_error(False) > 0.1
  else:
    assert first_compressed_error(False) < 1e-5


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_each_phase_compiles_its_own_collectives_and_no_conditional(name):
  compressor = LOW_RANK[name](2, warmup_steps=WARMUP)
  run = Run(compressor)
  volumes = run.dp.comm_bytes(PARAMS)["data"]
  dense = sum(x.nbytes for x in PARAMS.values())
  assert volumes["dense"] == acp_jax.CommVolume(all_reduce=dense)
  phases = run.dp.phase_states(run.state.comm)
  assert list(phases) == list(volumes)
  for phase, comm in phases.items():
    text = (
        run.step.lower(run.params, run.state._replace(comm=comm), *run.batch(0))
        .compile(compiler_options=helpers.ONE_BY_ONE)
        .as_text()
    )
    assert "conditional(" not in text
    stats = hlo.collective_stats(text)
    loss = 4  # the loss that value_and_grad averages
    assert stats["all-reduce"].bytes == volumes[phase].total + loss, phase


def test_at_step_inside_jit_is_refused_naming_the_loop():
  """at_step picks the program a step compiles: it runs on the host."""
  dp = acp_jax.DataParallel(
      acp_jax.acp_sgd(2, warmup_steps=2), helpers.mesh()
  )
  state = dp.chain(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(ValueError, match="outside jit.*dp.at_step"):
    jax.jit(dp.at_step)(state, 1)


def test_phase_at_and_at_step_follow_the_schedule():
  tx = acp_jax.acp_sgd(2, warmup_steps=2)
  assert [tx.phase_at(i) for i in range(6)] == [
      "dense", "dense", "p", "q", "p", "q"
  ]
  state = tx.init(PARAMS)
  assert acp_jax.phase.phase_of(state.phase) is acp_jax.Phase.DENSE
  assert tx.at_step(state, 1) is state  # nothing to do, no device touched
  # The switch follows the state's count: a state that has taken no step
  # stays in its warm-up.
  assert tx.at_step(state, 2) is state
  p = tx.at_step(state._replace(count=jnp.int32(2)), 2)
  assert acp_jax.phase.phase_of(p.phase) is acp_jax.Phase.P
  assert tx.at_step(p, 3) is p  # the update itself alternates P and Q
  back = tx.at_step(p._replace(count=jnp.int32(0)), 0)
  assert acp_jax.phase.phase_of(back.phase) is acp_jax.Phase.DENSE
  plain = acp_jax.power_sgd(2)
  assert plain.at_step(plain.init(PARAMS), 5) is not None
  assert [plain.phase_at(i) for i in range(2)] == ["step", "step"]
  with pytest.raises(ValueError, match="step must be a non-negative int"):
    tx.at_step(state, -1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_warmup_steps_raise(bad):
  with pytest.raises(ValueError, match=r"warmup_steps must be a non-negative int"):
    acp_jax.acp_sgd(2, warmup_steps=bad)


@pytest.mark.parametrize("name", sorted(LOW_RANK))
@pytest.mark.parametrize("stop", [WARMUP - 1, WARMUP + 1])
@pytest.mark.slow
def test_resume_inside_and_just_after_the_warmup_is_bitwise(name, stop, tmp_path):
  make = lambda: LOW_RANK[name](2, warmup_steps=WARMUP)
  straight = Run(make()).run(STEPS)[-1]
  first = Run(make())
  first.run(stop)
  checkpoint.save(
      tmp_path / "ckpt",
      {"params": first.params, "opt": first.state},
      compressor=first.dp.compressor,
  )
  resumed = Run(make())
  like = {"params": resumed.params, "opt": resumed.state}
  restored = checkpoint.restore(
      tmp_path / "ckpt",
      checkpoint.target(tmp_path / "ckpt", like),
      compressor=resumed.dp.compressor,
  )
  resumed.params, resumed.state = restored["params"], restored["opt"]
  resumed.done = stop
  chex.assert_trees_all_equal(resumed.run(STEPS - stop)[-1], straight)


def test_nnx_optimizer_leaves_the_warmup_in_place():
  nnx = pytest.importorskip("flax.nnx")
  # The model and loss of the NNX loops' tests.
  from tests import test_data_parallel  # pylint: disable=g-import-not-at-top

  dp = acp_jax.DataParallel(
      acp_jax.acp_sgd(2, warmup_steps=1), helpers.mesh()
  )
  model = test_data_parallel.Mlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, dp.chain(optax.sgd(0.1)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = dp.value_and_grad(test_data_parallel.nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  shapes = []
  for i in range(3):
    assert dp.at_step(optimizer, i) is optimizer
    shapes.append(optimizer.opt_state.comm.phase.shape)
    step(model, optimizer, XS[i], YS[i])
  assert shapes == [(3, 3, 3), (1,), (2, 2)]


def _loop(compressor, steps, at_step):
  """``Run``'s loop with ``at_step(run, i)`` in place of the switch."""
  run = Run(compressor)
  history = []
  for i in range(steps):
    at_step(run, i)
    run.params, run.state, _ = jax.block_until_ready(
        run.step(run.params, run.state, *run.batch(i))
    )
    history.append(helpers.to_numpy(run.params))
  return run, history


def _assigned(step_of):
  def at_step(run, i):
    run.state = run.dp.at_step(run.state, step_of(i))

  return at_step


@pytest.mark.parametrize(
    "at_step",
    [
        pytest.param(lambda run, i: None, id="forgotten"),
        pytest.param(lambda run, i: run.dp.at_step(run.state, i), id="dropped"),
        pytest.param(_assigned(lambda i: max(i - 1, 0)), id="one_behind"),
    ],
)
@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_a_warmup_that_does_not_end_raises_at_its_first_extra_step(
    name, at_step
):
  """Forgetting at_step, dropping its result, lagging: S-SGD forever."""
  with pytest.raises(Exception, match="warm-up should have ended") as error:
    _loop(LOW_RANK[name](2, warmup_steps=WARMUP), STEPS, at_step)
  assert f"after {WARMUP} steps" in str(error.value)


def test_a_warmup_that_does_not_end_is_one_error_naming_at_step():
  """Each device's check raised; the step fails with one of them, whose
  message leads with the fix."""
  with pytest.raises(Exception, match="at_step was not called") as error:
    _loop(acp_jax.acp_sgd(2, warmup_steps=WARMUP), STEPS, lambda r, i: None)
  assert str(error.value).count("the warm-up should have ended") == 1


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_a_step_counted_from_one_still_warms_up_for_warmup_steps(name):
  """A step counted from 1 would end the warm-up a step early."""
  make = lambda: LOW_RANK[name](2, warmup_steps=WARMUP)
  straight = Run(make()).run(STEPS)
  _, ahead = _loop(make(), STEPS, _assigned(lambda i: i + 1))
  chex.assert_trees_all_equal(ahead, straight)


def test_going_back_into_the_warmup_after_it_is_refused():
  """at_step(state, 0) after the warm-up would silently train S-SGD again."""
  run = Run(acp_jax.acp_sgd(2, warmup_steps=2))
  run.run(5)
  with pytest.raises(ValueError, match=r"at_step\(state, 0\).*taken 5 steps"):
    run.dp.at_step(run.state, 0)


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_a_warmup_state_given_to_a_compressor_without_warmup_is_refused(name):
  """A warm-up state given to acp_sgd(4) without warmup ran dense forever."""
  saved = Run(LOW_RANK[name](2, warmup_steps=WARMUP))
  saved.run(1)
  now = Run(LOW_RANK[name](2))
  now.params, now.state = saved.params, saved.state
  now.done = 1
  message = "no warmup_steps.*saved during a warm-up"
  with pytest.raises(ValueError, match=message):
    now.run(1)


@pytest.mark.parametrize("name", sorted(LOW_RANK))
def test_at_step_switches_a_pmapped_state(name):
  """at_step on a jax.pmap state (stacked marker) raised on its shape."""
  compressor = LOW_RANK[name](2, warmup_steps=WARMUP)
  tx = optax.chain(compressor, optax.sgd(0.1, momentum=0.9))

  def step(params, state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  stacked = jax.tree.map(lambda a: np.stack([a] * NUM_DEVICES), PARAMS)
  state = jax.pmap(tx.init, axis_name="data")(stacked)
  pstep = jax.pmap(step, axis_name="data")
  phases = []
  for i in range(STEPS):
    state = (compressor.at_step(state[0], i), *state[1:])
    phases.append(state[0].next_phase)
    stacked, state = pstep(
        stacked,
        state,
        XS[i].reshape(NUM_DEVICES, -1, 12),
        YS[i].reshape(NUM_DEVICES, -1),
    )
  expected = [acp_jax.Phase.DENSE] * WARMUP + (
      [acp_jax.Phase.P, acp_jax.Phase.Q, acp_jax.Phase.P]
      if name == "acp_sgd"
      else [acp_jax.Phase.P] * 3
  )
  assert phases == expected
  reference = Run(LOW_RANK[name](2, warmup_steps=WARMUP)).run(STEPS)[-1]
  chex.assert_trees_all_close(
      jax.tree.map(lambda a: a[0], helpers.to_numpy(stacked)),
      reference,
      rtol=1e-5,
      atol=1e-6,
  )
