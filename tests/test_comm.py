"""What the compiled update really sends equals what comm_bytes says."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

import acp_jax
from acp_jax import collectives
from acp_jax import lowrank
from acp_jax_tools import _hlo_text
from acp_jax_tools import hlo
from tests import helpers
from tests import shapes
from tests.conftest import NUM_DEVICES
from tests.test_suite import all_compressors
from tests.test_suite import COMPRESSORS

# Every layer kind of ResNet-50 (stem, bottlenecks with projections, BN,
# head) at a width that compiles in seconds.
SMALL_RESNET = shapes.resnet(blocks=(1, 1, 1, 1), width=8, num_classes=10)


def hlo_volume(tx, params, state):
  traffic = hlo.traffic(helpers.compiled_update(tx, params, state))
  sent = {kind for kind, stats in traffic.items() if stats.count}
  assert sent <= {"all-reduce", "all-gather"}, traffic
  return acp_jax.CommVolume(
      all_reduce=traffic["all-reduce"].bytes,
      all_gather=traffic["all-gather"].bytes,
  )


def assert_compiled_bytes_equal_accounting(name, params, **options):
  tx = COMPRESSORS[name].make(**options)
  expected = acp_jax.comm_bytes(tx, params, num_devices=NUM_DEVICES)
  if name == "ssgd_bf16" and jax.default_backend() == "cpu":
    # XLA:CPU widens bf16 all-reduces to f32 (its reducer is "_promoted");
    # GPUs send the bf16 buffer that the accounting counts.
    expected = {
        k: v._replace(all_reduce=2 * v.all_reduce) for k, v in expected.items()
    }
  states = helpers.phase_states(tx, params)
  assert set(expected) == set(states)
  for phase, state in states.items():
    assert hlo_volume(tx, params, state) == expected[phase], phase


@all_compressors
def test_compiled_bytes_equal_accounting(name):
  assert_compiled_bytes_equal_accounting(name, SMALL_RESNET)


# About a fifth of the small ResNet's gradient bytes: a bucket a stage or so.
SMALL_BUCKETS = 100_000


@all_compressors
@pytest.mark.slow
def test_compiled_bytes_equal_accounting_in_buckets(name):
  assert_compiled_bytes_equal_accounting(
      name, SMALL_RESNET, bucket_bytes=SMALL_BUCKETS
  )


def collective_inputs(text):
  """For each collective of a compiled module's entry computation, the
  numbers of the entry parameters it depends on."""
  entry, computations = _hlo_text.computations(text)
  instructions = computations[entry]
  names = {i.name for i in instructions}
  operands = {
      i.name: [r for r in i.references if r in names] for i in instructions
  }
  number = dict(
      re.findall(r"^\s*(%[\w.\-]+) = .* parameter\(([0-9]+)\)", text, re.M)
  )
  closure = hlo._closure
  return [
      {int(number[a]) for a in closure(i.name, operands) if a in number}
      for i in instructions
      if _hlo_text.collective_kind(i.op)
  ]


def across_processes(monkeypatch):
  """Make the compressors trace as they do on XLA:CPU across processes,
  where each array of an all-reduce is a network message of its own."""
  monkeypatch.setattr(collectives, "network_sends_each_operand", lambda: True)


@pytest.mark.parametrize(
    "name, processes",
    [
        ("ssgd", 1),
        ("ssgd", 2),  # its leaves stay apart: their bytes outweigh latency
        ("acp_sgd", 1),
        ("acp_sgd", 2),  # its small factors go packed, in one bucket
        ("sign_sgd", 1),
        ("topk_sgd", 1),
    ],
)
@pytest.mark.slow
def test_each_collective_waits_only_for_its_own_bucket(
    name, processes, monkeypatch
):
  if processes > 1:
    across_processes(monkeypatch)
  tx = COMPRESSORS[name].make(bucket_bytes=SMALL_BUCKETS)
  buckets = {frozenset(b) for b in tx.buckets(SMALL_RESNET)}
  if name == "acp_sgd" and processes > 1:
    assert len(buckets) == 1  # as Power-SGD's on a CPU
  else:
    assert len(buckets) > 3
  num_leaves = len(jax.tree.leaves(SMALL_RESNET))
  for state in helpers.phase_states(tx, SMALL_RESNET).values():
    text = helpers.compiled_update(
        tx, SMALL_RESNET, state, helpers.ONE_BY_ONE
    ).as_text()
    inputs = collective_inputs(text)
    # The gradients are the first parameters, in leaf order; a bucket's
    # collectives also read its own leaves' state (residuals, factors).
    grads = [frozenset(i for i in x if i < num_leaves) for x in inputs]
    if name == "ssgd" or (name == "acp_sgd" and processes == 1):
      # An all-reduce per leaf, each waiting for its own leaf only.
      assert sorted(grads, key=min) == [
          frozenset({i}) for i in range(num_leaves)
      ]
    else:  # an all-gather per bucket
      assert set(grads) == buckets
    for x, g in zip(inputs, grads):
      assert any(g <= b for b in buckets)
      others = set().union(*(y for y, h in zip(inputs, grads) if h != g))
      assert not x & others


def test_acp_sgd_packed_round_equals_its_arrays_sent_one_by_one(monkeypatch):
  tx = acp_jax.acp_sgd(2, bucket_bytes=SMALL_BUCKETS)
  params = helpers.MIXED
  state = helpers.replicate(tx.init(params))
  grads = [helpers.random_grads(seed, params) for seed in range(3)]

  def steps():
    step = helpers.per_device(tx.update)  # traced anew on every call
    s, out = state, []
    for g in grads:  # a P-step, a Q-step, a P-step
      u, s = step(g, s)
      out.append(u)
    return helpers.to_numpy(out)

  one_by_one = steps()
  across_processes(monkeypatch)
  chex.assert_trees_all_close(steps(), one_by_one, rtol=1e-6, atol=1e-7)


@all_compressors
@pytest.mark.parametrize(
    "params",
    [
        {**helpers.MIXED, "empty": jnp.zeros((0, 4))},
        {"empty": jnp.zeros((0, 4)), "none": jnp.zeros((0,))},
    ],
    ids=["with_an_empty_leaf", "all_empty"],
)
def test_compiled_bytes_equal_accounting_with_zero_size_leaves(name, params):
  assert_compiled_bytes_equal_accounting(name, params)


def dense_bytes(params, rank):
  specs = lowrank.settings("test", rank).plan(params)
  return collectives.dense_nbytes(
      [x for x, spec in zip(jax.tree.leaves(params), specs) if spec is None]
  )


@pytest.mark.slow
def test_acp_phases_add_up_to_one_power_sgd_step_plus_dense_leaves():
  acp, power = acp_jax.acp_sgd(4), acp_jax.power_sgd(4)
  a = {
      phase: hlo_volume(acp, SMALL_RESNET, state).all_reduce
      for phase, state in helpers.phase_states(acp, SMALL_RESNET).items()
  }
  (p_state,) = helpers.phase_states(power, SMALL_RESNET).values()
  p = hlo_volume(power, SMALL_RESNET, p_state).all_reduce
  dense = dense_bytes(SMALL_RESNET, 4)
  assert 0 < dense < a["p"] and 0 < dense < a["q"]
  assert a["p"] + a["q"] == p + dense


@pytest.mark.skipif(
    jax.__version_info__ < (0, 10),
    reason="XLA:CPU before jax 0.10 does not combine independent all-reduces",
)
@pytest.mark.parametrize(
    "name, all_reduces, all_gathers, rounds",
    [
        # XLA:CPU combines every all-reduce that does not wait on another:
        ("acp_sgd", 1, 0, 1),  # factors and dense leaves, together
        ("power_sgd", 2, 0, 2),  # P, then Q: the second needs the first
        ("ssgd", 1, 0, 1),
        ("sign_sgd", 0, 2, 1),  # packed signs, scales
        ("sign_sgd_vote", 0, 1, 1),
        ("topk_sgd", 0, 2, 1),  # values, indices
    ],
)
@pytest.mark.slow
def test_collectives_per_step(name, all_reduces, all_gathers, rounds):
  tx = COMPRESSORS[name].make()
  for state in helpers.phase_states(tx, SMALL_RESNET).values():
    text = helpers.compiled_update(tx, SMALL_RESNET, state).as_text()
    traffic = hlo.traffic(text)
    assert traffic["all-reduce"].count == all_reduces
    assert traffic["all-gather"].count == all_gathers
    assert hlo.collective_rounds(text) == rounds


@pytest.mark.parametrize(
    "check_vma",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not hasattr(jax.lax, "pcast"), reason="no lax.pcast in this jax"
            ),
        ),
        False,
    ],
)
def test_grad_step_sends_only_the_compressed_bytes(check_vma):
  """jax.grad under shard_map adds no dense all-reduce when params are cast
  to varying (check_vma=True) or when varying axes are not tracked."""
  tx = acp_jax.acp_sgd(2)
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}
  x = jnp.ones((NUM_DEVICES * 4, 16))

  def step(params, state, x):
    state = jax.tree.map(lambda a: a[0], state)
    if check_vma:
      params = jax.lax.pcast(params, helpers.AXIS, to="varying")
    g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
    u, state = tx.update(g, state)
    return jax.tree.map(lambda a: a[None], (u, state))

  P = jax.sharding.PartitionSpec
  f = jax.jit(
      jax.shard_map(
          step,
          mesh=helpers.mesh(),
          in_specs=(P(), P(helpers.AXIS), P(helpers.AXIS)),
          out_specs=P(helpers.AXIS),
          check_vma=check_vma,
      )
  )
  state = helpers.replicate(tx.init(params))
  traffic = hlo.traffic(f.lower(params, state, x).compile())
  expected = acp_jax.comm_bytes(tx, params, num_devices=NUM_DEVICES)["p"]
  assert {kind for kind, stats in traffic.items() if stats.count} == {
      "all-reduce"
  }
  assert traffic["all-reduce"].bytes == expected.total


@pytest.mark.slow
@all_compressors
def test_resnet50_compiled_bytes_equal_accounting(name):
  params = shapes.resnet()
  assert shapes.num_params(params) == 25_557_032  # torchvision's ResNet-50
  assert_compiled_bytes_equal_accounting(name, params)


@pytest.mark.parametrize(
    "make, expected",
    [
        # helpers.MIXED: conv 3x3x4x8 (288 = 36 x 8), dense 16x12 (192), bias
        # 12, tiny 2x3 (6, too small to compress at rank 2), scalar; fp32.
        (acp_jax.ssgd, {"step": (499 * 4, 0)}),
        # Bits 36 + 24 + 2 + 1 + 1, five float32 scales, from each of 8.
        (acp_jax.sign_sgd, {"step": (0, 8 * (64 + 5 * 4))}),
        # k = 58, 39, 3, 2, 1 values (4 bytes) and int32 indices.
        (lambda: acp_jax.topk_sgd(0.2), {"step": (0, 8 * 103 * 8)}),
        # (36 + 8) x 2 and (16 + 12) x 2 factor entries, 19 dense entries.
        (lambda: acp_jax.power_sgd(2), {"step": ((88 + 56 + 19) * 4, 0)}),
        (
            lambda: acp_jax.acp_sgd(2),
            {"p": ((72 + 32 + 19) * 4, 0), "q": ((16 + 24 + 19) * 4, 0)},
        ),
    ],
)
def test_accounting_by_hand(make, expected):
  volume = acp_jax.comm_bytes(make(), helpers.MIXED, num_devices=8)
  assert volume == {
      phase: acp_jax.CommVolume(*v) for phase, v in expected.items()
  }
