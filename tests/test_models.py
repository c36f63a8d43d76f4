"""Tests for train/models/: exact parameter counts, forward passes, BN.

Full-size models are only built abstractly (`nnx.eval_shape`). Small models
get their values from NumPy rather than from their initializers: on 2 CPU
cores every jax.random call compiles a program per shape, which would cost
tens of seconds per model here.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests import helpers
from train import models

# Small configurations for the structural tests: one per model class. The
# other ResNets differ only in blocks, checked by the parameter-count tests.
TINY_BERT = {"num_layers": 2, "hidden": 32, "heads": 2, "ffn": 64}
TINY = {
    "resnet18": dict(stem="cifar", num_classes=10),
    "vgg16": dict(head="cifar", num_classes=10),
    "bert": dict(size=TINY_BERT, vocab_size=50, max_len=16),
    "char_lm": dict(vocab_size=11, max_len=8, dim=16, num_layers=2),
    "small_cnn": dict(width=4),
}


def abstract(name, **kwargs):
  return nnx.eval_shape(lambda: models.create(name, rngs=nnx.Rngs(0), **kwargs))


def materialize(model, seed=0):
  """Gives an abstract model concrete values drawn by NumPy.

  Params are small random values; BN running means start at 0 and variances
  at 1, as their initializers would set them.
  """
  rng = np.random.default_rng(seed)
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  params = jax.tree.map(
      lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype),
      params,
  )
  stats = jax.tree.map_with_path(
      lambda path, s: jnp.full(s.shape, "var" in str(path[-2:]), s.dtype),
      stats,
  )
  return nnx.merge(graphdef, params, stats)


def tiny(name, seed=0, **overrides):
  return materialize(abstract(name, **{**TINY[name], **overrides}), seed)


@functools.partial(nnx.jit, static_argnames="train")
def forward(model, inputs, train, dropout_key=None):
  # A key rather than an nnx.Rngs crosses the jit boundary, so that calls
  # with different keys reuse one compilation.
  rngs = None if dropout_key is None else nnx.Rngs(dropout=dropout_key)
  return model(inputs, train=train, rngs=rngs)


def snapshot(model, kind):
  return [np.array(v) for v in jax.tree.leaves(nnx.state(model, kind))]


def images(shape, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def tokens(shape, vocab, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape))


# torchvision / HuggingFace counts. The CIFAR variants differ from the
# ImageNet ones only in the stem conv and the head:
#   resnet18 cifar: 11,689,512 - 7*7*3*64 + 3*3*3*64 - (512*1000 + 1000)
#                   + (512*10 + 10) = 11,173,962
#   vgg16 cifar:    138,357,544 - (7*7*512*4096 + 4096) - (4096*4096 + 4096)
#                   - (4096*1000 + 1000) + (512*10 + 10) = 14,719,818
PARAM_COUNTS = [
    ("resnet18", {}, 11_689_512),
    ("resnet34", {}, 21_797_672),
    ("resnet50", {}, 25_557_032),
    ("resnet152", {}, 60_192_808),
    ("resnet18", dict(stem="cifar", num_classes=10), 11_173_962),
    ("vgg16", {}, 138_357_544),
    ("vgg16", dict(head="cifar", num_classes=10), 14_719_818),
    ("bert", {}, 109_514_298),
    ("bert", dict(size="large"), 335_174_458),
]


@pytest.mark.parametrize(
    "name,kwargs,expected",
    PARAM_COUNTS,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(PARAM_COUNTS)],
)
def test_param_count_matches_reference(name, kwargs, expected):
  model = abstract(name, **kwargs)
  assert models.num_params(model) == expected
  # Exhaustive: nnx.split raises on state its filters leave over.
  nnx.split(model, nnx.Param, nnx.BatchStat)


def test_bert_param_count_follows_its_decomposition():
  # The formula in Bert's docstring, on a size where a miscounted term would
  # not be hidden by the large embedding tables.
  v, p, t, h, f, n = 50, 16, 2, 32, 64, 2
  expected = (
      (v + p + t) * h
      + 2 * h
      + n * (4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h)
      + (h * h + h)
      + 2 * h
      + v
  )
  assert models.num_params(abstract("bert", **TINY["bert"])) == expected


def test_num_params_reads_states():
  model = abstract("small_cnn", width=4)
  _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  count = models.num_params(model)
  assert models.num_params(params) == count
  # BatchStats in a full state are not parameters.
  assert models.num_params(nnx.state(model)) == count
  assert models.num_params(stats) == 0


FORWARD = [
    ("resnet18", {}, (2, 32, 32, 3), 10),
    ("vgg16", {}, (2, 32, 32, 3), 10),
    ("small_cnn", {}, (2, 8, 8, 1), 10),
    ("small_cnn", {}, (2, 28, 28, 1), 10),
]


@pytest.mark.parametrize(
    "name,kwargs,shape,num_classes",
    FORWARD,
    ids=[f"{n}-{s[1]}" for n, _, s, _ in FORWARD],
)
def test_image_forward_and_batch_stats(name, kwargs, shape, num_classes):
  model = tiny(name, **kwargs)
  x = images(shape)
  stats = snapshot(model, nnx.BatchStat)

  logits = forward(model, x, train=False)
  assert logits.shape == (shape[0], num_classes)
  assert np.isfinite(logits).all()
  np.testing.assert_equal(snapshot(model, nnx.BatchStat), stats)

  if not stats:
    return  # VGG has no BN, and without dropout train=True changes nothing.
  logits = forward(model, x, train=True)
  assert np.isfinite(logits).all()
  updated = snapshot(model, nnx.BatchStat)
  assert all(not np.allclose(a, b) for a, b in zip(stats, updated))


def test_bottleneck_resnet_with_imagenet_stem():
  # One block per stage keeps it small while covering the Bottleneck
  # projections and the max-pooled stem.
  model = materialize(
      nnx.eval_shape(
          lambda: models.ResNet(
              models.Bottleneck, (1, 1, 1, 1), rngs=nnx.Rngs(0), num_classes=7
          )
      )
  )
  stats = snapshot(model, nnx.BatchStat)
  logits = forward(model, images((2, 32, 32, 3)), train=True)
  assert logits.shape == (2, 7)
  assert np.isfinite(logits).all()
  updated = snapshot(model, nnx.BatchStat)
  assert all(not np.allclose(a, b) for a, b in zip(stats, updated))


def test_vgg16_imagenet_head_on_224():
  model = abstract("vgg16", num_classes=5)
  graphdef, state = nnx.split(model)
  out = jax.eval_shape(
      lambda s, x: nnx.merge(graphdef, s)(x, train=False),
      state,
      jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32),
  )
  assert out.shape == (1, 5) and out.dtype == jnp.float32


def test_bert_forward():
  model = tiny("bert")
  logits = forward(model, tokens((2, 8), 50), train=False)
  assert logits.shape == (2, 8, 50) and logits.dtype == jnp.float32
  assert np.isfinite(logits).all()


def test_char_lm_is_causal():
  model = tiny("char_lm")
  x = tokens((2, 8), 11)
  y = x.at[:, 5].set((x[:, 5] + 1) % 11)
  a = forward(model, x, train=False)
  b = forward(model, y, train=False)
  assert a.shape == (2, 8, 11)
  np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-6, atol=1e-6)
  assert not np.allclose(a[:, 5:], b[:, 5:])


def test_dropout_draws_from_call_rngs():
  model = tiny("char_lm", dropout=0.5, num_layers=1)
  x = tokens((2, 8), 11)
  with pytest.raises(ValueError, match="rngs"):
    model(x, train=True)
  # RBG keys: threefry's bit generator takes seconds to compile per dropout.
  key = functools.partial(jax.random.key, impl="rbg")
  a = forward(model, x, train=True, dropout_key=key(1))
  b = forward(model, x, train=True, dropout_key=key(1))
  c = forward(model, x, train=True, dropout_key=key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  # The calls left no Rngs behind in the model.
  nnx.split(model, nnx.Param, nnx.BatchStat)


@pytest.mark.parametrize("name", ["bert", "vgg16"])
def test_dropout_without_rngs_raises(name):
  model = abstract(name, **({} if name == "vgg16" else TINY[name]))
  graphdef, state = nnx.split(model)
  shape = (1, 224, 224, 3) if name == "vgg16" else (1, 4)
  dtype = jnp.float32 if name == "vgg16" else jnp.int32
  with pytest.raises(ValueError, match="rngs"):
    jax.eval_shape(
        lambda s, x: nnx.merge(graphdef, s)(x, train=True),
        state,
        jax.ShapeDtypeStruct(shape, dtype),
    )


@pytest.mark.parametrize("name", list(TINY))
def test_split_holds_only_params_and_batch_stats(name):
  model = abstract(name, **TINY[name])
  # nnx.split raises on any state its filters leave over, e.g. a stored Rngs.
  _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  assert jax.tree.leaves(params)
  has_bn = name.startswith("resnet") or name == "small_cnn"
  assert bool(jax.tree.leaves(stats)) == has_bn
  for leaf in jax.tree.leaves(nnx.state(model)):
    assert leaf.dtype == jnp.float32


def test_unknown_model_name_raises():
  with pytest.raises(ValueError, match="'resnet19'.*resnet18"):
    models.create("resnet19", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "small_cnn", "bert"])
def test_unknown_kwarg_raises(name):
  with pytest.raises(TypeError, match="num_clases"):
    models.create(name, rngs=nnx.Rngs(0), num_clases=10)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("resnet18", dict(stem="tiny")),
        ("vgg16", dict(head="tiny")),
        ("bert", dict(size="huge")),
        ("bert", dict(size={"num_layers": 2, "hidden": 32})),
        ("bert", dict(size={**TINY_BERT, "heads": 3})),
    ],
)
def test_bad_option_raises(name, kwargs):
  with pytest.raises(ValueError):
    abstract(name, **kwargs)


def test_constructor_signatures_are_readable():
  # The trainer reads them to fill num_classes / vocab_size from the data.
  for name, constructor in models.MODELS.items():
    params = inspect.signature(constructor).parameters
    assert {"rngs", "batch_norm_axis"} <= set(params), name
    assert ("num_classes" in params) != (name in ("bert", "char_lm")), name
  assert "vocab_size" in inspect.signature(models.MODELS["char_lm"]).parameters


def test_models_without_bn_accept_batch_norm_axis():
  model = abstract("bert", batch_norm_axis="data", **TINY["bert"])
  assert models.num_params(model) == models.num_params(
      abstract("bert", **TINY["bert"])
  )


def run_sharded(graphdef, params, stats, x):
  def body(params, stats, x):
    m = nnx.merge(graphdef, params, stats)
    return m(x, train=True), nnx.state(m, nnx.BatchStat)

  step = jax.jit(
      jax.shard_map(
          body,
          mesh=helpers.mesh(),
          in_specs=(P(), P(), P(helpers.AXIS)),
          out_specs=(P(helpers.AXIS), P()),
          check_vma=False,
      )
  )
  return jax.block_until_ready(step(params, stats, x))


def test_synchronized_batch_norm_matches_whole_batch():
  local = tiny("small_cnn")
  _, params, stats = nnx.split(local, nnx.Param, nnx.BatchStat)
  x = images((16, 8, 8, 1))
  synced_graphdef = nnx.graphdef(
      abstract("small_cnn", batch_norm_axis=helpers.AXIS, **TINY["small_cnn"])
  )

  y, new_stats = run_sharded(synced_graphdef, params, stats, x)

  expected = forward(local, x, train=True)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  for got, want in zip(
      jax.tree.leaves(new_stats), snapshot(local, nnx.BatchStat), strict=True
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Per-device statistics (batch_norm_axis=None) do differ on 2 samples each,
  # so the match above is the synchronization's doing.
  y_local, _ = run_sharded(nnx.graphdef(local), params, stats, x)
  assert not np.allclose(y_local, expected, rtol=1e-3, atol=1e-3)
