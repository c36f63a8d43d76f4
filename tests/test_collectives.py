"""Packed collectives split over a second axis give the unsplit results.

Eight simulated devices as 2 nodes x 4 devices per node: the collectives run
over "data", the buffers are split over "local".
"""

import collections
import math

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from acp_jax import buckets
from acp_jax import collectives
from tests.conftest import NUM_DEVICES

NODES, LOCAL = 2, NUM_DEVICES // 2
# Per leaf, what it sends: sizes that are no multiple of LOCAL, several
# dtypes in one bucket, an empty array, and a bucket of nothing but an empty
# array (it sends nothing).
SHAPES = [
    [((7,), jnp.float32), ((3,), jnp.int32)],
    [((2, 3), jnp.float32), ((5,), jnp.uint8)],
    [((0,), jnp.float32)],
    [((4, 0), jnp.int32)],
]
PLAN = ((3,), (2, 1, 0))


def mesh2d():
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh(
      (NODES, LOCAL), ("data", "local"), axis_types=(auto, auto)
  )


def node_arrays():
  """Arrays that are the same on a node's devices and differ across nodes."""
  node = lax.axis_index("data")
  return [
      [
          (jnp.arange(math.prod(shape)).reshape(shape) * 3 + 5 * node + 1)
          .astype(dtype)
          for shape, dtype in leaf
      ]
      for leaf in SHAPES
  ]


def run(collective, split):
  """``collective`` of ``node_arrays()`` on every device, with or without
  the split, and the collectives it went through, as traced."""

  def body():
    with collectives.split_over("local" if split else None):
      out = collective(node_arrays(), PLAN, "data")
    return jax.tree.map(lambda x: x[None], out)

  f = jax.jit(
      jax.shard_map(
          body, mesh=mesh2d(), in_specs=(), out_specs=P(("data", "local"))
      )
  )
  with collectives.recording() as sent:
    out = jax.block_until_ready(f())
  return out, sent


def expected(kind):
  """What every device holds after the collective, by NumPy."""
  out = []
  for leaf in SHAPES:
    out.append([])
    for shape, dtype in leaf:
      base = np.arange(math.prod(shape)).reshape(shape) * 3 + 1
      nodes = np.stack([base + 5 * node for node in range(NODES)])
      x = nodes if kind == "all_gather" else nodes.sum(0)
      out[-1].append(np.broadcast_to(x, (NUM_DEVICES,) + x.shape).astype(dtype))
  return out


# One collective per bucket and dtype that has elements (f32 7 + 6, int32 3,
# uint8 5); the empty buffers are not sent.
SIZES = {jnp.dtype(jnp.float32): 13, jnp.dtype(jnp.int32): 3,
         jnp.dtype(jnp.uint8): 5}


ARRAY_SIZES = [
    (jnp.dtype(jnp.float32), 7),
    (jnp.dtype(jnp.int32), 3),
    (jnp.dtype(jnp.float32), 6),
    (jnp.dtype(jnp.uint8), 5),
]


def test_packed_psum_sends_one_buffer_per_bucket_and_dtype():
  packed, sent = run(
      lambda *a: collectives.bucketed_psum(*a, packed=True), False
  )
  chex.assert_trees_all_equal(packed, expected("all_reduce"))
  assert collections.Counter(sent) == collections.Counter(
      collectives.Sent("all_reduce", "data", NODES, size, dtype)
      for dtype, size in SIZES.items()
  )


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_split_collectives_equal_the_unsplit_ones(kind):
  collective = {
      "all_reduce": collectives.bucketed_psum,
      "all_gather": collectives.bucketed_all_gather,
  }[kind]
  split, sent_split = run(collective, True)
  whole, sent_whole = run(collective, False)
  chex.assert_trees_all_equal(whole, expected(kind))
  chex.assert_trees_all_equal(split, whole)
  # Unsplit, an all-reduce sends each array with elements on its own,
  # copying nothing into a buffer; an all-gather packs each bucket.
  sizes = ARRAY_SIZES if kind == "all_reduce" else list(SIZES.items())
  assert collections.Counter(sent_whole) == collections.Counter(
      collectives.Sent(kind, "data", NODES, size, dtype)
      for dtype, size in sizes
  )
  # Each device sends its chunk of each buffer (padded up to a multiple of
  # LOCAL elements), and gets the others' chunks back over "local".
  lead = NODES if kind == "all_gather" else 1
  chunks = {dtype: -(-size // LOCAL) for dtype, size in SIZES.items()}
  assert collections.Counter(sent_split) == collections.Counter(
      [collectives.Sent(kind, "data", NODES, c, d) for d, c in chunks.items()]
      + [
          collectives.Sent("all_gather", "local", LOCAL, lead * c, d)
          for d, c in chunks.items()
      ]
  )


def test_split_over_the_collectives_own_axis_is_refused():
  def body():
    with collectives.split_over("data"):
      return collectives.bucketed_psum([[jnp.ones(3)]], ((0,),), "data")

  f = jax.shard_map(body, mesh=mesh2d(), in_specs=(), out_specs=P())
  with pytest.raises(ValueError, match="axis_name='data' is the collectives"):
    jax.eval_shape(f)


def test_an_axis_of_one_device_splits_nothing():
  mesh = jax.make_mesh(
      (NODES, 1),
      ("data", "local"),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=jax.devices()[:NODES],
  )

  def body():
    with collectives.split_over("local"):
      return collectives.bucketed_psum([[jnp.ones(3)]], ((0,),), "data")

  f = jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P())
  with collectives.recording() as sent:
    jax.eval_shape(f)
  assert sent == [collectives.Sent("all_reduce", "data", NODES, 3, jnp.float32)]


def test_bucket_plan_follows_the_leaf_order():
  sizes = [4, 4, 4, 4]
  assert buckets.bucket_plan(sizes, 8) == ((3, 2), (1, 0))
  assert buckets.bucket_plan(sizes, 8, (0, 3, 1, 2)) == ((0, 3), (1, 2))
  with pytest.raises(ValueError, match="does not order the 4 leaves"):
    buckets.bucket_plan(sizes, 8, (0, 1, 2))


def test_backward_order_puts_a_tied_embedding_last():
  params = {
      "a_embed": jnp.zeros((10, 4)),
      "b_hidden": jnp.zeros((4, 4)),
      "c_bias": jnp.zeros((4,)),
  }

  def loss(p, tokens):
    h = jnp.tanh(p["a_embed"][tokens] @ p["b_hidden"] + p["c_bias"])
    return jnp.sum(h @ p["a_embed"].T)  # the output shares the embedding

  tokens = jax.ShapeDtypeStruct((3,), jnp.int32)
  # The reverse of the leaf order would send the embedding first.
  assert buckets.backward_order(loss, params, tokens) == (2, 1, 0)
  # The same through a jitted loss, whose gradients one call returns.
  assert buckets.backward_order(jax.jit(loss), params, tokens) == (2, 1, 0)


def test_a_compressor_cuts_its_buckets_in_its_leaf_order():
  import acp_jax  # pylint: disable=g-import-not-at-top

  params = {k: jnp.zeros((64, 64)) for k in "abc"}
  size = 64 * 64 * 4
  for make in (acp_jax.ssgd, lambda **kw: acp_jax.acp_sgd(4, **kw)):
    tx = make(bucket_bytes=2 * size, leaf_order=(1, 0, 2))
    assert tx.buckets(params) == ((1, 0), (2,))
  with pytest.raises(ValueError, match="leaf_order must be None or"):
    acp_jax.power_sgd(4, leaf_order=(0, 0))
