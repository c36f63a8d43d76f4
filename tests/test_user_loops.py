"""Mistakes in users' own loops that DataParallel catches, or makes right.

Each test names in its docstring the mistake it guards; each compares with
the same loop without compression (a dense gradient over the global batch,
or the plain ``nnx.jit`` loop), or checks that the mistake is refused.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from tests import helpers
from tests.conftest import NUM_DEVICES

AXIS = helpers.AXIS
BATCH = 8 * NUM_DEVICES
RNG = np.random.default_rng(0)


def dp_of(compressor=None):
  return acp_jax.DataParallel(compressor or acp_jax.ssgd(), helpers.mesh())


def put(tree, spec):
  return jax.device_put(tree, NamedSharding(helpers.mesh(), spec))


def mean_over_devices(local_grads):
  """What ssgd's exchange sends on: the mean of the local gradients."""
  return jax.tree.map(lambda g: g.mean(0), local_grads.stacked)


def distinct_rows(masks):
  return len({row.tobytes() for row in np.asarray(masks).reshape(BATCH, -1)})


# -- randomness inside the loss ---------------------------------------------


class Dropped(nnx.Module):

  def __init__(self, rngs):
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    h = self.dropout(x)
    return self.out(h), h != 0


def dropped_loss(model, x):
  y, kept = model(x)
  return jnp.mean(y**2), kept


def test_nnx_dropout_draws_a_mask_per_row_like_the_plain_loop():
  """Dropout through an NNX Rngs stream: each device draws its own masks."""
  x = np.ones((BATCH, 32), np.float32)

  plain = Dropped(nnx.Rngs(0))
  _, plain_masks = nnx.jit(
      lambda m, x: nnx.value_and_grad(dropped_loss, has_aux=True)(m, x)[0]
  )(plain, x)

  dp = dp_of()
  model = Dropped(nnx.Rngs(0))
  (_, masks), _ = nnx.jit(
      lambda m, x: dp.value_and_grad(dropped_loss, has_aux=True)(m, x)
  )(model, put(x, P(AXIS)))
  assert distinct_rows(plain_masks) == BATCH
  assert distinct_rows(masks) == BATCH
  # The replicas keep the unfolded key, and its count advanced as in the
  # plain loop's one draw.
  keys = lambda m: jax.tree.map(jax.random.key_data, nnx.state(m, nnx.RngKey))
  chex.assert_trees_all_equal(keys(model), keys(plain))
  chex.assert_trees_all_equal(
      nnx.state(model, nnx.RngCount), nnx.state(plain, nnx.RngCount)
  )


def noisy_loss(params, x, key):
  kept = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.mean((jnp.where(kept, x, 0) @ params["w"]) ** 2), kept


@pytest.mark.parametrize("hierarchical", [False, True])
def test_a_key_argument_draws_a_mask_per_row_like_the_plain_loop(hierarchical):
  """A PRNG key passed to the loss: each device draws its own noise."""
  params = {"w": jnp.ones((32, 1))}
  x, key = np.ones((BATCH, 32), np.float32), jax.random.key(0)
  plain = jax.value_and_grad(noisy_loss, has_aux=True)
  (_, plain_masks), _ = plain(params, x, key)
  if hierarchical:  # 2 nodes of 4 devices: the index runs over both axes
    auto = jax.sharding.AxisType.Auto
    nodes = jax.make_mesh((2, NUM_DEVICES // 2), (AXIS, "local"), (auto, auto))
    dp = acp_jax.DataParallel(acp_jax.ssgd(), nodes, local_axis="local")
  else:
    dp = dp_of()
  (_, masks), _ = jax.jit(dp.value_and_grad(noisy_loss, has_aux=True))(
      params, x, key
  )
  assert distinct_rows(plain_masks) == BATCH
  assert distinct_rows(masks) == BATCH


# -- nothing between value_and_grad and chain --------------------------------


def tanh_loss(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)


def tanh_problem():
  params = {"w": jnp.asarray(RNG.standard_normal((12, 5)), jnp.float32)}
  x = RNG.standard_normal((BATCH, 12)).astype(np.float32)
  return params, put(x, P(AXIS))


def test_clipping_before_chain_is_refused_and_inside_it_clips_the_mean():
  """optax.chain(clip, dp.chain(tx)) would clip the stacked local gradients."""
  dp = dp_of()
  params, x = tanh_problem()
  _, grads = jax.jit(dp.value_and_grad(tanh_loss))(params, x)
  clip = optax.clip_by_global_norm(0.05)
  before = optax.chain(clip, dp.chain(optax.sgd(1.0)))
  where = r"after the compressor.*dp\.chain\(optax\.chain\(optax\.clip"
  with pytest.raises(TypeError, match=where):
    jax.jit(before.update)(grads, before.init(params), params)

  inside = dp.chain(optax.chain(clip, optax.sgd(1.0)))
  updates, _ = jax.jit(inside.update)(grads, inside.init(params), params)
  dense = jax.grad(tanh_loss)(params, x)
  norm = optax.tree.norm(dense)
  assert norm > 0.05  # so the clip acts
  chex.assert_trees_all_close(
      updates,
      jax.tree.map(lambda g: -g * 0.05 / norm, dense),
      rtol=1e-5,
      atol=1e-8,
  )


@pytest.mark.parametrize(
    "tx, error, match",
    [
        (optax.sgd(0.1), TypeError, "Only DataParallel.chain"),
        # JAX's structure error: the moments have the params' structure.
        (optax.adam(0.1), ValueError, "LocalGrads"),
    ],
    ids=["sgd", "adam"],
)
def test_a_plain_optimizer_given_local_gradients_is_refused(tx, error, match):
  """tx.update(local_grads) without dp.chain: params gain a device axis."""
  dp = dp_of()
  params, x = tanh_problem()

  @jax.jit
  def step(params, state, x):
    _, grads = dp.value_and_grad(tanh_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with pytest.raises(error, match=match):
    step(params, tx.init(params), x)


def test_local_gradients_add_up_and_scale():
  """Micro-batch accumulation with +, sum() and / keeps the guard."""
  dp = dp_of()
  params, x = tanh_problem()
  _, g = jax.jit(dp.value_and_grad(tanh_loss))(params, x)
  total = sum([g, g, g]) / 3
  assert isinstance(total, acp_jax.LocalGrads)
  chex.assert_trees_all_close(total.stacked, g.stacked, rtol=1e-6)
  chex.assert_trees_all_close((2 * g * 0.5).stacked, g.stacked, rtol=1e-6)
  with pytest.raises(TypeError, match="Only DataParallel.chain"):
    jax.tree.map(jnp.add, g, g)


def test_local_gradients_used_as_arrays_say_how_to_use_them():
  """Every first line names +, / and .stacked; a transform before dp.chain
  is told where it goes."""
  from acp_jax._local_grads import LocalGradsError

  dp = dp_of()
  params, x = tanh_problem()
  _, g = jax.jit(dp.value_and_grad(tanh_loss))(params, x)
  clip = optax.chain(optax.clip_by_global_norm(1.0), dp.chain(optax.sgd(0.1)))
  misuses = {
      "g.mean(0)": (LocalGradsError, lambda: g.mean(0)),
      "np.asarray(g)": (LocalGradsError, lambda: np.asarray(g)),
      "tree.map(jnp.add)": (TypeError, lambda: jax.tree.map(jnp.add, g, g)),
      "tree.map(.mean(0)) in jit": (
          TypeError,
          lambda: jax.jit(lambda g: jax.tree.map(lambda a: a.mean(0), g))(g),
      ),
      "clip before dp.chain": (
          TypeError,
          lambda: jax.jit(clip.update)(g, clip.init(params), params),
      ),
  }
  for name, (error, misuse) in misuses.items():
    with pytest.raises(error) as e:
      misuse()
    first = str(e.value).splitlines()[0]
    for words in ("add them with +", "* or /", ".stacked", "before dp.chain"):
      assert words in first, (name, words, first)
  assert getattr(g, "shape", None) is None  # a probe, not misuse


# -- BatchNorm ---------------------------------------------------------------


class NnxNormed(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def normed_loss(model, x, y):
  return jnp.mean((model(x)[:, 0] - y) ** 2)


def train_normed(value_and_grad, x, y, steps=3):
  model = NnxNormed(nnx.Rngs(0))
  tx = optax.sgd(0.1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    _, grads = value_and_grad(normed_loss)(model, x, y)
    optimizer.update(model, grads)

  for _ in range(steps):
    step(model, optimizer, x, y)
  return nnx.state(model)


def test_batch_norm_normalises_over_the_global_batch_like_the_plain_loop():
  """nnx.BatchNorm without axis_name: statistics over the global batch by
  default, as the plain loop's; batch_norm="local" keeps DDP's."""
  x = RNG.standard_normal((BATCH, 6)).astype(np.float32)
  x = x * (1 + np.arange(BATCH)[:, None] % 3).astype(np.float32)
  y = RNG.standard_normal((BATCH,)).astype(np.float32)
  plain = train_normed(nnx.value_and_grad, x, y)

  dp = dp_of()

  def compressed(batch_norm):
    def make(loss_fn):
      return dp.value_and_grad(loss_fn, batch_norm=batch_norm)

    model = NnxNormed(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dp.chain(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
      _, grads = make(normed_loss)(model, x, y)
      optimizer.update(model, grads)

    for _ in range(3):
      step(model, optimizer, *put((x, y), P(AXIS)))
    assert model.norm.axis_name is None
    return nnx.state(model)

  chex.assert_trees_all_close(
      compressed("global"), plain, rtol=1e-5, atol=1e-6
  )
  local = compressed("local")
  error = np.abs(local["norm"]["var"][...] - plain["norm"]["var"][...]).max()
  assert error > 1e-2


# -- losses normalised by a count -------------------------------------------


def masked_problem():
  """A regression on a padded batch: device d's shard keeps d + 1 rows."""
  params = {"w": RNG.standard_normal((6, 1)).astype(np.float32)}
  x = RNG.standard_normal((BATCH, 6)).astype(np.float32)
  y = RNG.standard_normal((BATCH,)).astype(np.float32)
  per = BATCH // NUM_DEVICES
  mask = (np.arange(per)[None] <= np.arange(NUM_DEVICES)[:, None]).ravel()
  return params, x, y, mask.astype(np.float32)


def masked_sum(params, x, y, mask):
  return jnp.sum(mask * ((x @ params["w"])[:, 0] - y) ** 2), jnp.sum(mask)


def masked_mean(params, x, y, mask):
  total, count = masked_sum(params, x, y, mask)
  return total / count


def test_a_masked_loss_returning_sum_and_count_is_the_global_mean():
  """A masked mean is normalised per shard, unlike the plain loop's over
  the global batch; a loss returning (sum, count) with
  normalize="global" gives the plain loop's exactly."""
  dp = dp_of()
  params, *batch = masked_problem()
  loss, dense = jax.value_and_grad(masked_mean)(params, *batch)
  batch = put(batch, P(AXIS))
  value, grads = jax.jit(
      dp.value_and_grad(masked_sum, normalize="global")
  )(params, *batch)
  chex.assert_trees_all_close(value, loss, rtol=1e-6)
  chex.assert_trees_all_close(
      mean_over_devices(grads), dense, rtol=1e-5, atol=1e-7
  )
  # The per-device mean, as DDP's: each shard's mean weighs alike.
  _, per_device = jax.jit(dp.value_and_grad(masked_mean))(params, *batch)
  error = np.abs(mean_over_devices(per_device)["w"] - dense["w"]).max()
  assert error > 1e-2 * np.abs(dense["w"]).max()
  with pytest.raises(TypeError, match="returning \\(sum, count\\)"):
    dp.value_and_grad(masked_mean, normalize="global")(params, *batch)
  with pytest.raises(ValueError, match="normalize must be one of"):
    dp.value_and_grad(masked_mean, normalize="mean")


# -- aux returned once ------------------------------------------------------


def test_a_per_device_aux_given_one_spec_for_all_devices_is_refused():
  """aux_specs=P() on a value each device computes from its own shard would
  return device 0's; averaged inside the loss, it is the plain loop's."""
  dp = dp_of()
  params, x = tanh_problem()

  def loss_and_mean(params, x):
    y = jnp.tanh(x @ params["w"])
    return jnp.mean(y**2), jnp.mean(y)

  def loss_and_global_mean(params, x):
    loss, mean = loss_and_mean(params, x)
    return loss, jax.lax.pmean(mean, AXIS)

  with pytest.raises(ValueError, match="aux_specs gives P\\(\\).*pmean"):
    jax.jit(dp.value_and_grad(loss_and_mean, has_aux=True, aux_specs=P()))(
        params, x
    )
  (_, mean), _ = jax.jit(
      dp.value_and_grad(loss_and_global_mean, has_aux=True, aux_specs=P())
  )(params, x)
  _, dense = loss_and_mean(params, np.asarray(x))
  chex.assert_trees_all_close(mean, dense, rtol=1e-5)
  # A value of the params alone is the same on every device.
  (_, norm), _ = jax.jit(
      dp.value_and_grad(
          lambda p, x: (tanh_loss(p, x), jnp.sum(p["w"] ** 2)),
          has_aux=True,
          aux_specs=P(),
      )
  )(params, x)
  chex.assert_trees_all_close(norm, jnp.sum(params["w"] ** 2), rtol=1e-6)


# -- which axis is the batch -------------------------------------------------

T = 16  # time steps: the leading axis of a time-major batch


def rnn_loss(params, x, y):
  """A recurrent net on a time-major batch, x (T, B, F) and y (T, B)."""

  def step(h, xt):
    h = jnp.tanh(xt @ params["wx"] + h @ params["wh"])
    return h, h @ params["out"]

  h0 = jnp.zeros((x.shape[1], params["wh"].shape[0]))
  _, logits = jax.lax.scan(step, h0, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def rnn_problem():
  params = {
      "wx": RNG.standard_normal((6, 8)).astype(np.float32) / 2,
      "wh": RNG.standard_normal((8, 8)).astype(np.float32) / 3,
      "out": RNG.standard_normal((8, 3)).astype(np.float32),
  }
  x = RNG.standard_normal((T, BATCH, 6)).astype(np.float32)
  y = RNG.integers(0, 3, (T, BATCH))
  return params, x, y


@pytest.mark.slow
def test_a_time_major_batch_splits_along_its_sharded_axis():
  """A (T, B, F) batch placed with P(None, 'data') is split along B."""
  dp = dp_of()
  params, x, y = rnn_problem()
  dense = jax.grad(rnn_loss)(params, x, y)
  placed = put((x, y), P(None, AXIS))
  _, by_sharding = dp.value_and_grad(rnn_loss)(params, *placed)
  chex.assert_trees_all_close(
      mean_over_devices(by_sharding), dense, rtol=1e-5, atol=1e-7
  )
  # Under jit on Auto mesh axes the sharding does not show: say it.
  specs = (P(None, AXIS), P(None, AXIS))
  _, by_spec = jax.jit(dp.value_and_grad(rnn_loss, batch_specs=specs))(
      params, *placed
  )
  chex.assert_trees_all_close(
      mean_over_devices(by_spec), dense, rtol=1e-5, atol=1e-7
  )
  # On Explicit mesh axes it does.
  explicit = jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,), axis_types=(explicit,))
  dp = acp_jax.DataParallel(acp_jax.ssgd(), mesh)
  placed = jax.device_put((x, y), NamedSharding(mesh, P(None, AXIS)))
  _, traced = jax.jit(dp.value_and_grad(rnn_loss))(
      jax.device_put(params, NamedSharding(mesh, P())), *placed
  )
  chex.assert_trees_all_close(
      mean_over_devices(traced), dense, rtol=1e-5, atol=1e-7
  )


def squared_error(params, x, y):
  return jnp.mean(((x @ params["w"])[:, 0] - y) ** 2)


def test_an_unplaced_batch_on_explicit_axes_names_the_fix():
  """A plain loop on jax.make_mesh's default Explicit axes hands unplaced
  arrays to the jitted step: refused naming the argument and the fix, not
  by shard_map's mismatch of specs; each fix gives the dense gradient."""
  explicit = jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,), axis_types=(explicit,))
  dp = acp_jax.DataParallel(acp_jax.ssgd(), mesh)
  params, x, y, _ = masked_problem()
  dense = jax.grad(squared_error)(params, x, y)
  step = jax.jit(dp.value_and_grad(squared_error))
  fix = r"jax\.device_put\(x, NamedSharding\(mesh, P\('data',?\)\)\)"
  with pytest.raises(ValueError, match=rf"^acp_jax .*argument 1 .*{fix}.*Auto"):
    step(params, jnp.asarray(x), jnp.asarray(y))
  sharding = NamedSharding(mesh, P(AXIS))
  _, placed = step(params, *jax.device_put((x, y), sharding))
  _, resharded = jax.jit(
      lambda p, *b: dp.value_and_grad(squared_error)(
          p, *(jax.reshard(v, sharding) for v in b)
      )
  )(params, jnp.asarray(x), jnp.asarray(y))
  for grads in (placed, resharded):
    chex.assert_trees_all_close(
        mean_over_devices(grads), dense, rtol=1e-5, atol=1e-7
    )


def test_a_time_major_batch_under_jit_on_auto_axes_is_refused():
  """Under jit on Auto axes a (T, B, F) batch beside (T, B) labels looks
  like a batch on axis 0: refused, where it would be split along time."""
  dp = dp_of()
  params, x, y = rnn_problem()
  dense = jax.grad(rnn_loss)(params, x, y)
  placed = put((x, y), P(None, AXIS))
  with pytest.raises(ValueError, match="ambiguous.*P\\(None, 'data'\\)"):
    jax.jit(dp.value_and_grad(rnn_loss))(params, *placed)
  # Said with batch_specs, it is the dense gradient.
  specs = (P(None, AXIS), P(None, AXIS))
  _, grads = jax.jit(dp.value_and_grad(rnn_loss, batch_specs=specs))(
      params, *placed
  )
  chex.assert_trees_all_close(
      mean_over_devices(grads), dense, rtol=1e-5, atol=1e-7
  )
  # Labels of one axis say that axis 0 is the batch.
  params, *batch = masked_problem()
  jax.jit(dp.value_and_grad(masked_mean))(params, *put(batch, P(AXIS)))


def test_a_batch_axis_that_disagrees_in_size_is_refused():
  """Time-major x beside labels y (B,): splitting both along axis 0 is
  ambiguous."""
  dp = dp_of()
  params, x, y = rnn_problem()
  hint = r"ambiguous.*batch_specs=.*P\(None, 'data'\)"
  with pytest.raises(ValueError, match=hint):
    jax.jit(dp.value_and_grad(lambda p, x, y: rnn_loss(p, x, y[None])))(
        params, x, y[0]
    )


def lm_loss(params, tokens, targets):
  logits = params["embed"][tokens] @ params["out"]
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
  ).mean()


def masked_pixels_loss(params, images, masks):
  return jnp.mean((images @ params["w"])[..., 0] * masks)


def one_hot_loss(params, x, labels):
  return optax.softmax_cross_entropy(x @ params["w"], labels).mean()


def next_step_loss(params, x):
  return jnp.mean((x[:-1] @ params["w"] - x[1:]) ** 2)


def time_major_loss(params, x, y):
  return rnn_loss(params, x, y)


def axis_problem(shapes):
  """Params and a batch of ``shapes`` for the loss of their case."""
  if len(shapes) == 1:
    x = RNG.standard_normal(shapes[0]).astype(np.float32)
    return next_step_loss, {"w": np.eye(32, dtype=np.float32) / 2}, (x,)
  (x_shape, y_shape) = shapes
  if len(x_shape) == 2 and x_shape == y_shape and x_shape[1] != 16:
    params = {
        "embed": RNG.standard_normal((10, 8)).astype(np.float32),
        "out": RNG.standard_normal((8, 10)).astype(np.float32),
    }
    batch = RNG.integers(0, 10, x_shape), RNG.integers(0, 10, y_shape)
    return lm_loss, params, batch
  if len(x_shape) == 2:
    params = {"w": RNG.standard_normal((16, 16)).astype(np.float32)}
    labels = jax.nn.one_hot(RNG.integers(0, 16, x_shape[0]), 16)
    return one_hot_loss, params, (RNG.standard_normal(x_shape), labels)
  if len(x_shape) == 4:
    params = {"w": RNG.standard_normal((3, 1)).astype(np.float32)}
    x = RNG.standard_normal(x_shape).astype(np.float32)
    return masked_pixels_loss, params, (x, RNG.uniform(size=y_shape))
  params = {
      "wx": RNG.standard_normal((x_shape[2], 8)).astype(np.float32) / 2,
      "wh": RNG.standard_normal((8, 8)).astype(np.float32) / 3,
      "out": RNG.standard_normal((8, 3)).astype(np.float32),
  }
  x = RNG.standard_normal(x_shape).astype(np.float32)
  return time_major_loss, params, (x, RNG.integers(0, 3, y_shape))


@pytest.mark.parametrize(
    "shapes, refused",
    [
        (((64, 64), (64, 64)), True),  # LM tokens and targets, B = T
        (((64, 128), (64, 128)), False),  # LM tokens and targets
        (((32, 32, 32, 3), (32, 32, 32)), True),  # images and masks, B = H
        (((64, 16), (64, 16)), False),  # features and one-hot labels
        (((16, 16, 32),), True),  # one time-major argument, T = B
        # Time-major, T = the number of devices; time-major beside labels.
        (((NUM_DEVICES, 16, 32), (NUM_DEVICES, 16)), True),
        (((T, BATCH, 6), (T, BATCH)), True),
    ],
)
def test_auto_axes_under_jit_give_the_dense_gradient_or_name_batch_specs(
    shapes, refused
):
  """Under jit on Auto mesh axes only shapes show: a batch is split along
  axis 0 where they say nothing against it, and gives the plain loop's loss
  and gradient; where a time-major axis 1 reads as well, it is refused
  naming batch_specs, and with them gives the plain loop's."""
  fun, params, batch = axis_problem(shapes)
  dense_loss, dense = jax.value_and_grad(fun)(params, *batch)
  dp = dp_of()
  step = jax.jit(dp.value_and_grad(fun))
  if refused:
    with pytest.raises(ValueError, match="ambiguous.*batch_specs"):
      step(params, *batch)
    # Axis 0 is the batch of every case but the time-major ones.
    major = 1 if fun in (next_step_loss, time_major_loss) else 0
    specs = tuple(P(*(None,) * major, AXIS) for _ in batch)
    step = jax.jit(dp.value_and_grad(fun, batch_specs=specs))
  loss, grads = step(params, *batch)
  chex.assert_trees_all_close(loss, dense_loss, rtol=1e-5)
  chex.assert_trees_all_close(
      mean_over_devices(grads), dense, rtol=1e-4, atol=1e-6
  )


class Normed(nn.Module):
  """Dense, synchronized BatchNorm over the data axis, dense."""

  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(NUM_DEVICES)(x)  # as many channels as devices
    x = nn.BatchNorm(
        use_running_average=False, momentum=0.9, axis_name=self.axis_name
    )(x)
    return nn.Dense(3)(jax.nn.relu(x))


def linen_loss(model):
  def loss(params, batch_stats, x, y):
    logits, updated = model.apply(
        {"params": params, "batch_stats": batch_stats},
        x,
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updated["batch_stats"]

  return loss


class Wide(nn.Module):
  """Dense to as many channels as the global batch has rows, then
  BatchNorm, synchronized over ``axis_name``."""

  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(BATCH)(x)
    x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)
    return nn.Dense(3)(jax.nn.relu(x))


def test_linen_batch_stats_of_as_many_channels_as_rows_name_batch_specs():
  """batch_stats of BATCH channels split like the batch: the loss fails on
  shapes, its error noted naming batch_specs; with P() it is the dense
  step."""
  x = RNG.standard_normal((BATCH, 5)).astype(np.float32)
  y = RNG.integers(0, 3, BATCH)
  variables = Wide().init(jax.random.key(0), x)
  params, batch_stats = variables["params"], variables["batch_stats"]
  dense = jax.grad(lambda p: linen_loss(Wide())(p, batch_stats, x, y)[0])(
      params
  )
  dp = dp_of()
  batch = put((x, y), P(AXIS))
  loss = linen_loss(Wide(axis_name=AXIS))
  with pytest.raises((TypeError, ValueError)) as error:
    dp.value_and_grad(loss, has_aux=True)(params, batch_stats, *batch)
  (note,) = [n for n in error.value.__notes__ if n.startswith("acp_jax:")]
  assert f"argument 1 [({BATCH},), ({BATCH},)]" in note
  assert "batch_specs=(" in note
  _, grads = dp.value_and_grad(
      loss, has_aux=True, batch_specs=(P(), None, None)
  )(params, batch_stats, *batch)
  chex.assert_trees_all_close(
      mean_over_devices(grads), dense, rtol=1e-5, atol=1e-6
  )


def test_linen_batch_stats_argument_is_passed_whole_by_its_spec():
  """Linen's loss(params, batch_stats, x, y): batch_stats must not be split."""
  x = RNG.standard_normal((BATCH, 5)).astype(np.float32)
  y = RNG.integers(0, 3, BATCH)
  variables = Normed().init(jax.random.key(0), x)
  params = variables["params"]
  # Running statistics that a few steps would have left, not the initial ones.
  batch_stats = jax.tree.map(
      lambda s: s + jnp.asarray(RNG.uniform(0.5, 1.5, s.shape), s.dtype),
      variables["batch_stats"],
  )
  (_, dense_stats), dense = jax.value_and_grad(
      linen_loss(Normed()), has_aux=True
  )(params, batch_stats, x, y)

  dp = dp_of()
  loss = linen_loss(Normed(axis_name=AXIS))
  batch = put((x, y), P(AXIS))
  hint = r"argument 1\['BatchNorm_0'\].*ambiguous.*batch_specs"
  with pytest.raises(ValueError, match=hint):
    jax.jit(dp.value_and_grad(loss, has_aux=True))(params, batch_stats, *batch)
  (_, stats), grads = jax.jit(
      dp.value_and_grad(
          loss, has_aux=True, aux_specs=P(), batch_specs=(P(), None, None)
      )
  )(params, batch_stats, *batch)
  chex.assert_trees_all_close(
      mean_over_devices(grads), dense, rtol=1e-5, atol=1e-6
  )
  chex.assert_trees_all_close(stats, dense_stats, rtol=1e-5, atol=1e-6)
