"""How much of a step each collective could run beside, read from HLO."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES

# Compute cost is output bytes: %a 32, %b 64, %c 96, of 192 in all. %a feeds
# the all-reduce and %b waits for it; %c feeds a second, unrelated one.
MODULE = """
HloModule jit_step

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8], y: f32[24]) -> (f32[16], f32[24]) {
  %x = f32[8]{0} parameter(0)
  %y = f32[24]{0} parameter(1)
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%sum
  %all-reduce = f32[8]{0} all-reduce(%a), channel_id=1, to_apply=%sum
  %b = f32[16]{0} fusion(%all-reduce), kind=kLoop, calls=%sum
  %c = f32[24]{0} fusion(%y), kind=kLoop, calls=%sum
  %all-reduce.1 = f32[24]{0} all-reduce(%c), channel_id=2, to_apply=%sum
  ROOT %out = (f32[16]{0}, f32[24]{0}) tuple(%b, %all-reduce.1)
}
"""


def by_name(report):
  return {c.name: c for c in report.collectives}


def test_shares_split_compute_into_before_after_and_beside():
  report = hlo.overlap_potential(MODULE)
  assert report.compute_bytes == 192
  first, second = report.collectives
  assert first == hlo.CollectiveOverlap(
      name="%all-reduce",
      kind="all-reduce",
      bytes=32,
      round=1,
      independent_share=96 / 192,
      ancestor_share=32 / 192,
      descendant_share=64 / 192,
      upstream_share=96 / 192,  # %c feeds the other all-reduce
  )
  assert second == hlo.CollectiveOverlap(
      name="%all-reduce.1",
      kind="all-reduce",
      bytes=96,
      round=1,
      independent_share=96 / 192,
      ancestor_share=96 / 192,
      descendant_share=0.0,
      upstream_share=32 / 192,  # %b comes after the exchanges
  )
  assert report.bytes_weighted_potential == pytest.approx(0.5)
  assert report.bytes_weighted_upstream_potential == pytest.approx(
      (32 * 96 / 192 + 96 * 32 / 192) / 128
  )


def test_a_chain_leaves_nothing_beside():
  chain = MODULE.replace("fusion(%y)", "fusion(%b)")
  first, second = hlo.overlap_potential(chain).collectives
  assert first.independent_share == second.independent_share == 0.0
  assert (first.ancestor_share, first.descendant_share) == (32 / 192, 160 / 192)
  assert second.round == 2


def test_async_pair_is_one_collective_and_control_edges_are_not_data():
  text = (
      MODULE.replace(
          "%all-reduce = f32[8]{0} all-reduce(%a)",
          "%ars = f32[8]{0} all-reduce-start(%a)",
      )
      .replace(
          "%b = f32[16]{0} fusion(%all-reduce)",
          "%ard = f32[8]{0} all-reduce-done(%ars)\n"
          "  %b = f32[16]{0} fusion(%ard)",
      )
      # The scheduler ran %c while the all-reduce was in flight.
      .replace(
          "calls=%sum\n  %all-reduce.1",
          "calls=%sum, control-predecessors={%ars}\n  %all-reduce.1",
      )
  )
  assert "control-predecessors={%ars}" in text
  first, _ = hlo.overlap_potential(text).collectives
  assert (first.name, first.kind, first.bytes) == ("%ars", "all-reduce", 32)
  assert first.independent_share == 96 / 192
  assert first.descendant_share == 64 / 192


def test_called_computations_weigh_as_their_caller():
  # %b becomes a call whose body holds a collective: the call is compute of
  # its output bytes, and the entry's later all-reduce is in round 3.
  text = MODULE.replace(
      "%b = f32[16]{0} fusion(%all-reduce), kind=kLoop, calls=%sum",
      "%b = f32[16]{0} call(%all-reduce), to_apply=%inner",
  ).replace("fusion(%y)", "fusion(%b)").replace(
      "ENTRY",
      """%inner (p: f32[8]) -> f32[16] {
  %p = f32[8]{0} parameter(0)
  %r = f32[8]{0} all-reduce(%p), to_apply=%sum
  ROOT %q = f32[16]{0} fusion(%r), kind=kLoop, calls=%sum
}

ENTRY""",
  )
  report = hlo.overlap_potential(text)
  names = [c.name for c in report.collectives]
  assert names == ["%all-reduce", "%all-reduce.1"]
  assert [c.round for c in report.collectives] == [1, 3]
  assert report.compute_bytes == 192
  first, second = report.collectives
  assert first.descendant_share == 160 / 192
  assert second.ancestor_share == 1.0


def test_without_collectives_or_compute():
  empty = hlo.overlap_potential("  %x = f32[2]{0} add(%a, %b)")
  assert empty == hlo.OverlapReport((), 0.0, 0.0, 0)
  (only,) = hlo.overlap_potential(
      "  %x = f32[2]{0} parameter(0)\n  %r = f32[2]{0} all-reduce(%x)"
  ).collectives
  assert only.independent_share == only.ancestor_share == 0.0


# A train step on the simulated devices: a 4-layer MLP whose backward
# produces the last layer's gradient first.
WIDTHS = (16, 32, 32, 32, 8)


def mlp_params():
  rng = np.random.default_rng(0)
  return [
      {
          "w": jnp.asarray(rng.standard_normal((m, n)), jnp.float32) / m**0.5,
          "b": jnp.zeros((n,)),
      }
      for m, n in zip(WIDTHS[:-1], WIDTHS[1:])
  ]


def mlp_loss(params, x, y):
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return jnp.mean((h - y) ** 2)


# A layer's kernel and bias, the largest layer's: a bucket per layer.
LAYER_BYTES = 4 * (32 * 32 + 32)


@functools.cache
def step_report(name, phase=None, combine=False, bucket_bytes=math.inf):
  make = {
      "ssgd": acp_jax.ssgd,
      "acp_sgd": lambda **kw: acp_jax.acp_sgd(2, **kw),
      "power_sgd": lambda **kw: acp_jax.power_sgd(2, **kw),
  }[name]
  dp = acp_jax.DataParallel(make(bucket_bytes=bucket_bytes), helpers.mesh())
  tx = dp.chain(optax.sgd(0.1))
  params = mlp_params()
  state = tx.init(params)
  if phase is not None:
    state = state._replace(comm=dp.phase_states(state.comm)[phase])

  def train_step(params, state, x, y):
    loss, grads = dp.value_and_grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  x = jnp.zeros((4 * NUM_DEVICES, WIDTHS[0]))
  y = jnp.zeros((4 * NUM_DEVICES, WIDTHS[-1]))
  compiled = (
      jax.jit(train_step)
      .lower(params, state, x, y)
      .compile(None if combine else helpers.ONE_BY_ONE)
  )
  return hlo.overlap_potential(compiled.as_text())


def gradient_all_reduces(report):
  """The all-reduces of gradients: all but the loss's scalar pmean."""
  return [c for c in report.collectives if c.bytes > 4]


def assert_shares_add_up(report):
  for c in report.collectives:
    total = c.independent_share + c.ancestor_share + c.descendant_share
    assert total == pytest.approx(1.0), c
    assert 0.0 <= c.upstream_share <= c.independent_share, c


def test_ssgd_leaf_all_reduces_overlap_the_rest_of_backprop():
  report = step_report("ssgd", bucket_bytes=1)  # a bucket per leaf
  assert_shares_add_up(report)
  grads = gradient_all_reduces(report)
  assert len(grads) == 2 * (len(WIDTHS) - 1)  # a kernel and a bias a layer
  assert {c.round for c in grads} == {1}
  assert max(c.upstream_share for c in grads) > 0.3
  assert report.bytes_weighted_upstream_potential > 0.3
  # The last layer's kernel (its gradient comes first) has more of backprop
  # beside it than the first layer's (its gradient comes last).
  kernel = {c.bytes: c for c in grads}
  assert kernel[32 * 8 * 4].upstream_share > kernel[16 * 32 * 4].upstream_share


def test_combined_all_reduce_waits_for_every_gradient():
  # XLA:CPU's combiner, on by default, merges the loss and every gradient.
  (combined,) = step_report("ssgd", combine=True).collectives
  assert combined.independent_share == 0.0


@pytest.mark.parametrize("phase", ["p", "q"])
def test_acp_sgd_combined_waits_for_all_of_backprop(phase):
  # XLA:CPU's combiner merges every factor's all-reduce into one.
  report = step_report("acp_sgd", phase, combine=True)
  assert_shares_add_up(report)
  (combined,) = gradient_all_reduces(report)  # factors and biases
  assert combined.round == 1
  assert combined.upstream_share < 0.1
  # What is beside it comes after backprop: the residual update, which
  # needs only this device's factor.
  assert combined.independent_share > combined.upstream_share


@pytest.mark.parametrize(
    "name, phase", [("ssgd", None), ("acp_sgd", "p"), ("acp_sgd", "q")]
)
def test_each_leaf_all_reduce_overlaps_the_backprop_of_the_others(
    name, phase
):
  # In one bucket or a bucket per layer, each leaf's gradient (or factor)
  # goes by its own all-reduce: nothing packs a bucket into one buffer that
  # would wait for its last leaf.
  for bucket_bytes in (math.inf, LAYER_BYTES):
    report = step_report(name, phase, bucket_bytes=bucket_bytes)
    assert_shares_add_up(report)
    grads = gradient_all_reduces(report)
    assert len(grads) == 2 * (len(WIDTHS) - 1)  # a kernel and a bias a layer
    assert {c.round for c in grads} == {1}
    assert all(c.upstream_share > 0.1 for c in grads)
    combined = step_report(name, phase, combine=True)
    assert (
        report.bytes_weighted_upstream_potential
        > combined.bytes_weighted_upstream_potential + 0.2
    )


def test_power_sgd_second_round_has_nothing_beside_it():
  report = step_report("power_sgd")
  assert_shares_add_up(report)
  (second,) = [c for c in report.collectives if c.round == 2]
  (first,) = [
      c
      for c in gradient_all_reduces(report)
      if c.round == 1 and c.bytes > second.bytes / 2
  ]
  assert second.independent_share < 0.1
  assert first.upstream_share < 0.1
