"""The cost model's formulas against hand-computed cases."""

import argparse

import numpy as np
import pytest

from acp_jax import registry
from acp_jax_tools import costmodel
from benchmarks import cluster
from benchmarks import worker

LINK = costmodel.Link(alpha=1e-3, beta=1e-8)


def test_ring_all_reduce():
  # 2 (p-1) alpha + 2 (p-1)/p B beta = 6 ms + 1.5 * 10 ms.
  assert costmodel.all_reduce_seconds(1e6, 4, LINK) == pytest.approx(0.021)
  # Two workers send the whole buffer once each way.
  assert costmodel.all_reduce_seconds(1e6, 2, LINK) == pytest.approx(0.012)
  assert costmodel.all_reduce_seconds(1e6, 1, LINK) == 0
  assert costmodel.all_reduce_seconds(0, 4, LINK) == 0


def test_ring_all_gather():
  # (p-1) alpha + (p-1) B beta with B each worker's part.
  assert costmodel.all_gather_seconds(1e6, 4, LINK) == pytest.approx(0.033)
  assert costmodel.all_gather_seconds(1e6, 1, LINK) == 0


def test_bad_worker_count_raises():
  with pytest.raises(ValueError, match="workers must be positive, got 0"):
    costmodel.all_reduce_seconds(1.0, 0, LINK)


def test_ideal_link():
  link = costmodel.Link.ideal(1000, alpha=5e-5)
  assert link.beta == pytest.approx(8e-9)  # 125 MB/s
  assert link.alpha == 5e-5


def test_traffic_splits_bytes_over_its_collectives():
  two_reduces = costmodel.Traffic(all_reduce=2e6, all_reduce_ops=2)
  assert two_reduces.seconds(4, LINK) == pytest.approx(2 * 0.021)
  # 8 MB gathered on 4 workers in 2 ops: parts of 1 MB.
  gathers = costmodel.Traffic(all_gather=8e6, all_gather_ops=2)
  assert gathers.seconds(4, LINK) == pytest.approx(2 * 0.033)
  both = costmodel.Traffic(2e6, 2, 8e6, 2)
  assert both.seconds(4, LINK) == pytest.approx(2 * 0.021 + 2 * 0.033)
  assert costmodel.Traffic().seconds(4, LINK) == 0


def test_traffic_without_collectives_for_its_bytes_raises():
  with pytest.raises(ValueError, match="100 bytes in 0 collectives"):
    costmodel.Traffic(all_reduce=100)


def test_overlap_hides_communication_of_pipelined_methods_only():
  traffic = costmodel.Traffic(all_reduce=1e6, all_reduce_ops=1)  # 21 ms
  step = lambda method, backward, overlap: costmodel.step_seconds(
      0.1, backward, traffic, method, 4, LINK, overlap
  )
  assert step("ssgd", 0.05, False) == pytest.approx(0.121)
  assert step("ssgd", 0.05, True) == pytest.approx(0.1)  # all hidden
  assert step("acp_sgd", 0.01, True) == pytest.approx(0.111)  # 10 ms hidden
  assert step("power_sgd", 0.05, True) == pytest.approx(0.121)
  assert step("sign_sgd", 0.05, True) == pytest.approx(0.121)


def test_fit_recovers_the_link():
  sizes = [2**12, 2**16, 2**20, 2**24]
  seconds = [costmodel.all_reduce_seconds(s, 4, LINK) for s in sizes]
  fitted = costmodel.fit_all_reduce(sizes, seconds, 4)
  np.testing.assert_allclose(
      [fitted.alpha, fitted.beta], [LINK.alpha, LINK.beta], rtol=1e-6
  )


def test_fit_needs_two_sizes_and_two_workers():
  with pytest.raises(ValueError, match="two sizes"):
    costmodel.fit_all_reduce([4096, 4096], [1.0, 1.1], 4)
  with pytest.raises(ValueError, match="at least 2 workers"):
    costmodel.fit_all_reduce([1, 2], [1.0, 2.0], 1)


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["ssgd", "power_sgd", "acp_sgd"])
def test_fused_rounds_match_the_compiled_step(compressor):
  """The projection fuses each round into one all-reduce: so does XLA, in
  the step the cluster workers run (here on the test's 8 devices)."""
  args = argparse.Namespace(workload="tiny", compressor=compressor, steps=1)
  _, dp, inner, params, batch, loss_fn = worker._data_parallel(args, "flat")
  tx = dp.chain(inner)
  step = worker._step_fn(dp, tx, loss_fn)
  phases = worker.step_traffic(step, dp, params, tx.init(params), batch)
  assert len(phases) == (2 if compressor == "acp_sgd" else 1)
  for phase in phases:
    assert phase["all_reduce_ops"] == registry.get(compressor).rounds
    assert phase["all_gather_ops"] == 0
    # The compressor's bytes (each device's) and the loss's 4.
    assert phase["all_reduce"] > 4


def test_prediction_adds_each_phases_communication_to_compute():
  phases = [
      {"all_reduce": 1e6, "all_reduce_ops": 1},
      {"all_reduce": 3e6, "all_reduce_ops": 1},
  ]
  # 4 workers: 2 (p - 1) alpha + 2 (p - 1) / p B beta per phase.
  comm = [6e-3 + 1.5 * b * 1e-8 for b in (1e6, 3e6)]
  assert cluster.predict(0.5, phases, 4, LINK) == pytest.approx(
      0.5 + sum(comm) / 2
  )
