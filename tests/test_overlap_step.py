"""The overlapped step (``DataParallel.step``) against the fused one."""

import logging
import os
import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import acp_jax
from acp_jax import overlap
from tests import helpers
from tests import overlap_process


def _put(params, x, y, dp):
  return (
      jax.device_put(params, dp._sharding(jax.sharding.PartitionSpec())),
      helpers.shard(x),
      helpers.shard(y),
  )


# Both steps donate every array but a phase marker, whose buffer no result
# of another phase could take.
@pytest.mark.filterwarnings("error:Some donated buffers were not usable")
@pytest.mark.parametrize("name", sorted(overlap_process.compressors()))
def test_overlapped_step_is_the_fused_step(name):
  # On simulated devices the programs run in lockstep, not beside each
  # other; the arithmetic is the multi-process step's.
  dp = acp_jax.DataParallel(
      overlap_process.compressors()[name], helpers.mesh()
  )
  params, x, y = _put(*overlap_process.problem(), dp)
  fused, overlapped, step = overlap_process.fused_and_overlapped(
      dp, params, x, y
  )
  chex.assert_trees_all_close(overlapped, fused, atol=1e-6, rtol=1e-6)
  # Last block first; the middle block completes its own segment.
  assert step.exchange_order == (2, 1, 0)


def test_a_param_read_by_two_blocks_goes_with_the_first():
  params, x, y = overlap_process.problem()
  first, middle, last = overlap_process.blocks()

  def tied(p, h, x, y):  # the last block reads w0 again, as a tied decoder
    return last(p, h, x, y) + 0.1 * jnp.mean(h @ p["w0"])

  blocks = [first, middle, tied]
  local = (x[:8], y[:8])
  plan = overlap.plan(blocks, params, local)
  leaves = sorted(params)  # b0, w0, w1, w2
  assert [[leaves[i] for i in s] for s in plan.segments] == [
      ["b0", "w0"],
      ["w1"],
      ["w2"],
  ]
  dp = acp_jax.DataParallel(acp_jax.acp_sgd(2), helpers.mesh())
  tx = optax.sgd(0.1)
  p, xs, ys = _put(params, x, y, dp)
  out = []
  for flag in (False, True):
    q = jax.tree.map(jnp.copy, p)  # the step donates it
    step, state = dp.step(tx, blocks, overlap=flag), dp.chain(tx).init(q)
    for t in range(3):
      q, state, _ = step(q, dp.at_step(state, t), xs, ys)
    out.append(q)
  chex.assert_trees_all_close(out[1], out[0], atol=1e-6, rtol=1e-6)


def _one_block(p, c, x, y):
  first, middle, last = overlap_process.blocks()
  return last(p, middle(p, first(p, c, x, y), x, y), x, y)


@pytest.mark.parametrize(
    "compressor, blocks, why",
    [
        (acp_jax.acp_sgd(2), [_one_block], "complete in one segment"),
        (
            acp_jax.power_sgd(2, warm_start=False),
            overlap_process.blocks(),
            "random factors",
        ),
    ],
)
def test_a_step_that_cannot_be_split_is_fused_with_a_line(
    caplog, compressor, blocks, why
):
  dp = acp_jax.DataParallel(compressor, helpers.mesh())
  params, x, y = _put(*overlap_process.problem(), dp)
  tx = optax.sgd(0.1)
  step = dp.step(tx, blocks, overlap=True)
  with caplog.at_level(logging.WARNING, logger="acp_jax.overlap"):
    step(params, dp.chain(tx).init(params), x, y)
  (record,) = caplog.records
  assert "the fused step" in record.getMessage()
  assert why in record.getMessage()
  assert step.exchange_order == ()


def test_the_default_is_the_fused_step():
  dp = acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh())
  step = dp.step(optax.sgd(0.1), overlap_process.blocks())
  assert not isinstance(step, overlap.OverlappedStep)


def test_misuse_is_refused():
  dp = acp_jax.DataParallel(acp_jax.ssgd(), helpers.mesh())
  with pytest.raises(TypeError, match="blocks must be"):
    dp.step(optax.sgd(0.1), [])
  with pytest.raises(ValueError, match="overlap must be"):
    dp.step(optax.sgd(0.1), overlap_process.blocks(), overlap="yes")


def test_the_runtime_interfaces_it_relies_on_exist():
  # A jaxlib upgrade that drops execution streams fails here, by name,
  # rather than in a user's step.
  from jaxlib import xla_client

  assert callable(xla_client.execution_stream_id)
  with overlap.stream_context():
    assert float(jax.jit(lambda a: a + 1)(1.0)) == 2.0


@pytest.mark.slow
def test_two_processes_overlap_every_compressor_as_the_fused_step():
  procs = helpers.launch(
      ["-m", "tests.overlap_process"], 2, env={**os.environ, "XLA_FLAGS": ""}
  )
  outputs = helpers.finish(procs, timeout=300)
  results = []
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-3000:]
    results.append(re.findall(r"^RESULT (\S+) (\S+) (\S+) (\S+)$", out, re.M))
  assert results[0] and len(results[0]) == len(overlap_process.compressors())
  for (name, diff, digest, order), other in zip(*results):
    assert float(diff) < 1e-6, name
    # Both processes end with the same params, having dispatched their
    # exchanges in one order, last block first.
    assert (digest, order) == (other[2], other[3]), name
    assert order == "2,1,0", name
