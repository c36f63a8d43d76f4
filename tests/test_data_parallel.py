"""acp_jax.DataParallel in users' own loops: Flax NNX, optax wrappers, orbax."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from acp_jax import checkpoint
from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES

AXIS = helpers.AXIS
RNG = np.random.default_rng(0)
X = RNG.standard_normal((4 * NUM_DEVICES, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 4 * NUM_DEVICES)


class Mlp(nnx.Module):

  def __init__(self, rngs, batch_norm=False):
    self.hidden = nnx.Linear(12, 24, rngs=rngs)
    self.norm = nnx.BatchNorm(24, rngs=rngs) if batch_norm else None
    self.out = nnx.Linear(24, 5, rngs=rngs)

  def __call__(self, x):
    h = self.hidden(x)
    if self.norm is not None:
      h = self.norm(h)
    return self.out(jax.nn.relu(h))


def nnx_loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def batch():
  return jax.device_put((X, Y), NamedSharding(helpers.mesh(), P(AXIS)))


def pure_loss(graphdef):
  return lambda params, x, y: nnx_loss(nnx.merge(graphdef, params), x, y)


def pure_mlp():
  """``Mlp`` as plain functions: its loss of ``(params, x, y)`` and its
  params, a dict."""
  graphdef, params = nnx.split(Mlp(nnx.Rngs(0)))
  return pure_loss(graphdef), nnx.to_pure_dict(params)


def functional_losses(compressor, steps):
  """The reference: the raw transform in a hand-written shard_map step."""
  loss_fn, params = pure_mlp()
  tx = optax.chain(compressor, optax.adam(1e-2))

  def local(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

  step = helpers.per_device_state(local)
  state = helpers.replicate(tx.init(params))
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, *batch())
    losses.append(float(loss))
  return losses


def make_nnx(dp, batch_norm=False):
  model = Mlp(nnx.Rngs(0), batch_norm)
  return model, nnx.Optimizer(model, dp.chain(optax.adam(1e-2)), wrt=nnx.Param)


@nnx.jit(static_argnums=0)
def nnx_step(dp, model, optimizer, x, y):
  loss, grads = dp.value_and_grad(nnx_loss)(model, x, y)
  optimizer.update(model, grads)
  return loss


def dp_of(compressor):
  return acp_jax.DataParallel(compressor, helpers.mesh())


@pytest.mark.parametrize("name", ["acp_sgd", "power_sgd", "ssgd"])
def test_nnx_optimizer_with_data_parallel_trains_like_the_functional_step(name):
  make = {
      "acp_sgd": lambda: acp_jax.acp_sgd(2),
      "power_sgd": lambda: acp_jax.power_sgd(2),
      "ssgd": acp_jax.ssgd,
  }[name]
  dp = dp_of(make())
  model, optimizer = make_nnx(dp)
  losses = [float(nnx_step(dp, model, optimizer, *batch())) for _ in range(6)]
  np.testing.assert_allclose(losses, functional_losses(make(), 6), rtol=1e-6)
  if name == "acp_sgd":
    assert optimizer.opt_state.comm.phase.shape == (1,)  # P after 6 steps


def test_compressor_inside_nnx_optimizer_trains_like_the_functional_step():
  """The raw transform inside nnx.Optimizer's chain, under a user's own
  shard_map: the phase advances (it is an array), so the losses match."""
  model = Mlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, optax.chain(acp_jax.acp_sgd(2), optax.adam(1e-2)), wrt=nnx.Param
  )
  graphdef, params, opt_state = nnx.split((model, optimizer), nnx.Param, ...)

  def local(params, opt_state, x, y):
    model, optimizer = nnx.merge(graphdef, params, opt_state)
    loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    _, params, opt_state = nnx.split((model, optimizer), nnx.Param, ...)
    return params, opt_state, jax.lax.pmean(loss, AXIS)

  step = helpers.per_device_state(local)
  opt_state = helpers.replicate(opt_state)
  losses = []
  for _ in range(6):
    params, opt_state, loss = step(params, opt_state, *batch())
    losses.append(float(loss))
  np.testing.assert_allclose(
      losses, functional_losses(acp_jax.acp_sgd(2), 6), rtol=1e-6
  )


@pytest.mark.slow
def test_orbax_round_trip_in_q_phase_resumes_bitwise(tmp_path):
  dp = dp_of(acp_jax.acp_sgd(2))
  model, optimizer = make_nnx(dp, batch_norm=True)
  losses = []
  for step in range(6):
    losses.append(float(nnx_step(dp, model, optimizer, *batch())))
    if step == 2:  # three steps taken: the next one is a Q-step
      assert optimizer.opt_state.comm.next_phase is acp_jax.Phase.Q
      checkpoint.save(
          tmp_path / "ckpt",
          nnx.state((model, optimizer)),
          compressor=dp.compressor,
      )
  model, optimizer = make_nnx(dp, batch_norm=True)  # a fresh init: phase P
  restored = checkpoint.restore(
      tmp_path / "ckpt", nnx.state((model, optimizer)), compressor=dp.compressor
  )
  nnx.update((model, optimizer), restored)
  assert optimizer.opt_state.comm.next_phase is acp_jax.Phase.Q
  resumed = [float(nnx_step(dp, model, optimizer, *batch())) for _ in range(3)]
  assert resumed == losses[3:]


def test_checkpoint_stores_only_the_residuals_per_device(tmp_path):
  dp = dp_of(acp_jax.acp_sgd(2))
  params = nnx.to_pure_dict(nnx.state(Mlp(nnx.Rngs(0))))
  state = dp.chain(optax.sgd(0.1, momentum=0.9)).init(params)
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    stacked = x.shape[:1] == (NUM_DEVICES,) and x.sharding.spec == P(AXIS)
    assert stacked == ("comm.error" in jax.tree_util.keystr(path)), path


@pytest.mark.parametrize(
    "saved, now, message",
    [
        (
            lambda: acp_jax.acp_sgd(2),
            lambda: acp_jax.acp_sgd(4),
            r"\.comm\.p\['w'\]: saved float32\[16, 2\] .* now float32\[16, 4\]",
        ),
        (
            lambda: acp_jax.topk_sgd(0.5),
            lambda: acp_jax.acp_sgd(2),
            r"only in the live state: \['comm.count', 'comm.p.w', 'comm.phase',"
            r" 'comm.q.w'\]",
        ),
    ],
)
def test_restore_refuses_a_checkpoint_of_another_compressor(
    tmp_path, saved, now, message
):
  params = {"w": jnp.ones((16, 64))}
  # Saved unchecked (compressor=None): the shapes alone tell them apart.
  state = dp_of(saved()).chain(optax.sgd(0.1)).init(params)
  checkpoint.save(tmp_path / "c", state, compressor=None)
  like = dp_of(now()).chain(optax.sgd(0.1)).init(params)
  with pytest.raises(ValueError, match=message):
    checkpoint.restore(tmp_path / "c", like)


def test_accumulated_micro_batches_equal_one_large_batch():
  """k micro-batches' local gradients added up, one compressed exchange."""
  dp = dp_of(acp_jax.acp_sgd(2))
  loss_fn, params = pure_mlp()
  tx = dp.chain(optax.sgd(0.1))

  @jax.jit
  def whole(params, state, x, y):
    _, grads = dp.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)

  @jax.jit
  def accumulated(params, state, x, y):
    # Each device's rows, in two halves: micro-batch i takes rows
    # [i*h, (i+1)*h) of every device's shard.
    per = x.shape[0] // NUM_DEVICES
    xs = x.reshape(NUM_DEVICES, 2, per // 2, -1).swapaxes(0, 1)
    ys = y.reshape(NUM_DEVICES, 2, per // 2).swapaxes(0, 1)
    grads = None
    for i in range(2):
      micro = (xs[i].reshape(-1, x.shape[1]), ys[i].reshape(-1))
      _, g = dp.value_and_grad(loss_fn)(params, *micro)
      grads = g if grads is None else grads + g
    grads = grads / 2
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)

  state = tx.init(params)
  chex.assert_trees_all_close(
      accumulated(params, state, *batch()),
      whole(params, state, *batch()),
      rtol=1e-5,
      atol=1e-6,
  )
  text = accumulated.lower(params, state, *batch()).compile().as_text()
  volume = acp_jax.comm_bytes(dp.compressor, params, num_devices=NUM_DEVICES)
  # One exchange for both micro-batches (their unused losses are dropped).
  assert hlo.collective_stats(text)["all-reduce"].bytes == (
      volume["p"].all_reduce
  )


@pytest.mark.parametrize(
    "make", [lambda: acp_jax.acp_sgd(2), lambda: acp_jax.power_sgd(2), acp_jax.ssgd]
)
def test_compiled_step_sends_the_accounting_plus_the_loss(make):
  dp = dp_of(make())
  loss_fn, params = pure_mlp()
  tx = dp.chain(optax.adam(1e-3))
  step = helpers.train_step(dp, tx, loss_fn)
  state = tx.init(params)
  volume = acp_jax.comm_bytes(dp.compressor, params, num_devices=NUM_DEVICES)
  for phase, comm in dp.phase_states(state.comm).items():
    text = step.lower(params, state._replace(comm=comm), *batch()).compile()
    stats = hlo.collective_stats(text.as_text())
    assert set(stats) == {"all-reduce"}
    assert stats["all-reduce"].bytes == volume[phase].total + 4, phase


def test_a_freezing_wrt_filter_is_told_to_keep_the_guard_and_then_freezes():
  """nnx.Optimizer(..., wrt=filter) that freezes some params drops the
  local gradients' guard; the filter the refusal names trains as the plain
  loop with the user's filter does."""
  only_out = nnx.All(nnx.Param, nnx.PathContains("out"))

  def trained(value_and_grad, tx, wrt):
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def step(model, optimizer, x, y):
      _, grads = value_and_grad(nnx_loss)(model, x, y)
      optimizer.update(model, grads)

    step(model, optimizer, *batch())
    return nnx.state(model, nnx.Param)

  plain = trained(nnx.value_and_grad, optax.sgd(0.1), only_out)
  dp = dp_of(acp_jax.ssgd())
  with pytest.raises(TypeError, match="PathContains\\('guard'\\)"):
    trained(dp.value_and_grad, dp.chain(optax.sgd(0.1)), only_out)
  frozen = trained(
      dp.value_and_grad,
      dp.chain(optax.sgd(0.1)),
      nnx.Any(only_out, nnx.PathContains("guard")),
  )
  chex.assert_trees_all_close(frozen, plain, rtol=1e-5, atol=1e-7)
  initial = nnx.state(Mlp(nnx.Rngs(0)), nnx.Param)
  chex.assert_trees_all_equal(frozen["hidden"], initial["hidden"])


class MlpWithUnusedLayer(Mlp):

  def __init__(self, rngs):
    super().__init__(rngs)
    self.unused = nnx.Linear(128, 128, rngs=rngs)


@pytest.mark.parametrize(
    "make", [lambda: acp_jax.acp_sgd(2), lambda: acp_jax.power_sgd(2), acp_jax.ssgd]
)
def test_comm_bytes_given_the_loss_equal_the_compiled_step_with_an_unused_layer(
    make,
):
  """XLA folds the collective of a gradient it knows is zero: S-SGD's
  all-reduce of the unused 128x128 layer, ACP-SGD's of its bias."""
  dp = dp_of(make())
  model = MlpWithUnusedLayer(nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  tx = dp.chain(optax.sgd(0.1))

  @jax.jit
  def step(params, state, x, y):
    loss, grads = dp.value_and_grad(pure_loss(graphdef))(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  every = dp.comm_bytes(params)[AXIS]
  read = dp.comm_bytes(params, pure_loss(graphdef), *batch())[AXIS]
  # A module and its loss tell the same.
  assert dp.comm_bytes(model, nnx_loss, *batch())[AXIS] == read
  for phase, comm in dp.phase_states(state.comm).items():
    compiled = step.lower(params, state._replace(comm=comm), *batch()).compile()
    stats = hlo.collective_stats(compiled.as_text())
    # The 4 bytes are the loss's mean.
    assert stats["all-reduce"].bytes == read[phase].total + 4, phase
    # Power-SGD packs the bias with its factors, which are sent.
    unsent = {"ssgd": 128 * 129, "acp_sgd": 128, "power_sgd": 0}
    assert every[phase].total - read[phase].total == (
        4 * unsent[dp.compressor.made_by[0]]
    )


class BatchNormCnn(nnx.Module):
  """A CNN with BatchNorm and Dropout: state that the step updates."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(4 * 4 * 8, 5, rngs=rngs)

  def __call__(self, x):
    h = self.drop(jax.nn.relu(self.norm(self.conv(x))))
    return self.out(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("batch_norm", ["global", "local"])
@pytest.mark.parametrize("make", [lambda: acp_jax.acp_sgd(2), acp_jax.ssgd])
def test_comm_bytes_of_a_batch_norm_cnn_equal_the_compiled_step(
    make, batch_norm
):
  """comm_bytes given the loss runs on a module with BatchNorm and Dropout,
  leaves it as it was, and counts the statistics' all-reduces: their mean
  and its gradient under global BatchNorm, the running statistics averaged
  after the step under both."""
  dp = dp_of(make())
  model = BatchNormCnn(nnx.Rngs(0))
  images = jax.device_put(
      RNG.standard_normal((4 * NUM_DEVICES, 4, 4, 1)).astype(np.float32),
      NamedSharding(helpers.mesh(), P(AXIS)),
  )
  labels = batch()[1]
  updated = (nnx.BatchStat, nnx.RngCount)
  before = nnx.clone(nnx.state(model, *updated))
  counted = dp.comm_bytes(model, nnx_loss, images, labels, batch_norm=batch_norm)
  chex.assert_trees_all_equal(nnx.state(model, *updated), before)
  optimizer = nnx.Optimizer(model, dp.chain(optax.sgd(0.1)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    value_and_grad = dp.value_and_grad(nnx_loss, batch_norm=batch_norm)
    loss, grads = value_and_grad(model, x, y)
    optimizer.update(model, grads)
    return loss

  compiled = step.lower(model, optimizer, images, labels).compile()
  sent = hlo.collective_stats(compiled.as_text())["all-reduce"].bytes
  first = next(iter(counted[AXIS].values()))  # the phase init starts in
  # The 4 bytes are the loss's mean; 8 features' mean and mean of squares,
  # float32, make 64.
  assert sent == first.total + 4
  params = dp.comm_bytes(model)[AXIS]
  statistics = {"global": 3 * 64, "local": 64}[batch_norm]
  assert first.total - next(iter(params.values())).total == statistics


@pytest.mark.parametrize(
    "wrap, error",
    [
        (lambda tx: optax.MultiSteps(tx, every_k_schedule=2), ValueError),
        (
            lambda tx: optax.masked(
                tx, lambda p: jax.tree.map(lambda _: True, p)
            ),
            ValueError,
        ),
        (lambda tx: optax.apply_if_finite(tx, 2), TypeError),
    ],
    ids=["multisteps", "masked", "apply_if_finite"],
)
@pytest.mark.parametrize("loop", ["pytree", "nnx"])
def test_a_wrapper_around_chain_is_refused_by_jax(wrap, error, loop):
  """A wrapper around dp.chain(tx) combines the local gradients with a tree
  of the params' structure (an accumulator, a mask, lax.cond's other
  branch) before any code of this library runs: JAX refuses the two
  structures, naming LocalGrads, or under nnx.Optimizer, which hands them
  on as an nnx.State, their fields (the mistakes page says so)."""
  dp = dp_of(acp_jax.acp_sgd(2))
  tx = wrap(dp.chain(optax.sgd(0.1)))
  if loop == "pytree":
    loss_fn, params = pure_mlp()

    @jax.jit
    def step(params, state, x, y):
      _, grads = dp.value_and_grad(loss_fn)(params, x, y)
      return tx.update(grads, state, params)

    run = lambda: step(params, tx.init(params), *batch())
    named = "LocalGrads"
  else:
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_update(model, optimizer, x, y):
      _, grads = dp.value_and_grad(nnx_loss)(model, x, y)
      optimizer.update(model, grads)

    run = lambda: nnx_update(model, optimizer, *batch())
    named = r"'guard', 'stacked'"
  with pytest.raises(error, match=named):
    run()


def test_masked_inside_chain_masks_the_mean():
  """The fix the refusal names: the mask applies to the compressed mean."""
  dp = dp_of(acp_jax.ssgd())
  loss_fn, params = pure_mlp()
  mask = jax.tree.map(lambda p: p.ndim == 2, params)
  masked = dp.chain(optax.masked(optax.sgd(0.1), mask))
  plain = dp.chain(optax.sgd(0.1))

  @jax.jit
  def updates(params, x, y):
    _, grads = dp.value_and_grad(loss_fn)(params, x, y)
    return (
        masked.update(grads, masked.init(params), params)[0],
        plain.update(grads, plain.init(params), params)[0],
    )

  got, sgd = updates(params, *batch())
  for is_masked, u, p in zip(*map(jax.tree.leaves, (mask, got, sgd))):
    # Unmasked leaves pass the mean through: sgd's update over -0.1.
    np.testing.assert_allclose(u, p if is_masked else -p / 0.1, rtol=1e-5)


@pytest.mark.parametrize("nested", [False, True])
def test_multisteps_inside_chain_is_refused(nested):
  """dp.chain(optax.MultiSteps(opt, k)) would send at every micro-step."""
  dp = dp_of(acp_jax.acp_sgd(2))
  inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  tx = (
      optax.chain(optax.clip(1.0), inner.gradient_transformation())
      if nested
      else inner
  )
  _, params = pure_mlp()
  with pytest.raises(ValueError, match="holds optax.MultiSteps.*with \\+"):
    dp.chain(tx).init(params)
  # acp_jax.chain, for loops of one's own under pmap or shard_map, alike.
  with pytest.raises(
      ValueError, match="acp_jax.chain: the optimizer holds optax.MultiSteps"
  ):
    acp_jax.chain(acp_jax.acp_sgd(2), tx).init(params)


def test_a_raw_compressor_under_multisteps_is_refused_when_debugging(
    monkeypatch,
):
  """With the placement debug flag, a compressor that no placing
  composition runs is refused: here inside optax.MultiSteps's lax.cond."""
  monkeypatch.setenv("ACP_JAX_DEBUG_PLACEMENT", "1")
  tx = optax.MultiSteps(
      optax.chain(acp_jax.power_sgd(2), optax.sgd(0.1)), every_k_schedule=2
  )
  update = helpers.mapped(tx.update, "shard_map")
  with pytest.raises(ValueError, match="outside acp_jax.chain"):
    update(
        helpers.random_grads(0, helpers.MIXED),
        helpers.replicate(tx.init(helpers.MIXED)),
    )


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
def test_masking_a_compressor_is_refused_naming_keep_dense(wrapper):
  mask = jax.tree.map(lambda x: x.ndim > 1, helpers.MIXED)
  if wrapper == "masked":
    tx = optax.masked(acp_jax.acp_sgd(2), mask)
  else:
    labels = jax.tree.map(lambda m: "c" if m else "d", mask)
    tx = optax.multi_transform(
        {"c": acp_jax.acp_sgd(2), "d": optax.identity()}, labels
    )
  with pytest.raises(ValueError, match="keep_dense"):
    tx.init(helpers.MIXED)


def test_inject_hyperparams_names_static_args_and_works_with_them():
  with pytest.raises(ValueError, match="static_args=.*'rank'"):
    optax.inject_hyperparams(acp_jax.acp_sgd)(rank=2).init(helpers.MIXED)
  # The settings ride in options (or **settings), which optax keeps static.
  injected = optax.inject_hyperparams(acp_jax.acp_sgd, static_args=("rank",))(
      rank=2, options=acp_jax.LowRankOptions(seed=0), warm_start=True
  )
  grads = helpers.random_grads(0, helpers.MIXED)
  by_inject, _ = helpers.mapped(injected.update, "shard_map")(
      grads, helpers.replicate(injected.init(helpers.MIXED))
  )
  plain = acp_jax.acp_sgd(2)
  by_plain, _ = helpers.mapped(plain.update, "shard_map")(
      grads, helpers.replicate(plain.init(helpers.MIXED))
  )
  chex.assert_trees_all_equal(by_inject, by_plain)


def test_scan_over_step_pairs_equals_the_loop_and_single_steps_are_refused():
  dp = dp_of(acp_jax.acp_sgd(2))
  loss_fn, params = pure_mlp()
  tx = dp.chain(optax.sgd(0.1))
  x, y = batch()

  def one(carry, _):
    params, state = carry
    loss, grads = dp.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), loss

  def two(carry, _):
    carry, first = one(carry, None)
    carry, second = one(carry, None)
    return carry, jnp.stack([first, second])

  state = tx.init(params)
  _, scanned = jax.jit(lambda c: jax.lax.scan(two, c, length=2))((params, state))
  carry, looped = (params, state), []
  for _ in range(4):
    carry, loss = jax.jit(one)(carry, None)
    looped.append(float(loss))
  np.testing.assert_allclose(np.ravel(scanned), looped, rtol=1e-6)
  with pytest.raises(TypeError, match="phase"):
    jax.lax.scan(one, (params, state), length=2)


def test_misuse_is_refused_early():
  with pytest.raises(TypeError, match="acp_jax factory"):
    acp_jax.DataParallel(optax.sgd(0.1), helpers.mesh())
  with pytest.raises(ValueError, match="axis_name='batch'"):
    acp_jax.DataParallel(acp_jax.ssgd(axis_name="batch"), helpers.mesh())
  dp = dp_of(acp_jax.acp_sgd(2))
  params = {"w": jnp.ones((12, 5))}
  loss_fn = lambda p, x: (x @ p["w"]).sum()
  with pytest.raises(ValueError, match="split evenly over the 8 devices"):
    dp.value_and_grad(loss_fn)(params, jnp.ones((12, 12)))
  tx = dp.chain(optax.sgd(0.1))
  with pytest.raises(TypeError, match="DataParallel.value_and_grad"):
    tx.update(jax.grad(loss_fn)(params, jnp.ones((8, 12))), tx.init(params), params)
