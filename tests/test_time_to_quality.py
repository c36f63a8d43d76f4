"""Time to quality: steps to a target, S-SGD's targets, the composition of
steps and step time, and its check against a run end to end."""

import math

import pytest

from benchmarks import thresholds
from benchmarks import time_to_quality as ttq


def test_steps_to_a_target_is_the_first_evaluation_at_or_below_it():
  curve = {100: 3.0, 200: 2.5, 300: 2.6, 400: 2.4}
  assert ttq.steps_to(curve, 2.5) == 200  # reached exactly counts
  assert ttq.steps_to(curve, 2.55) == 200  # not the later dip's 400
  assert ttq.steps_to(curve, 2.4) == 400
  assert ttq.steps_to(curve, 2.0) == math.inf  # the cap came first


def test_targets_are_what_every_s_sgd_seed_reached():
  ssgd = {
      0: {100: 3.0, 200: 2.0, 300: 1.5, 400: 1.2},
      1: {100: 3.2, 200: 2.2, 300: 1.4, 400: 1.3},
  }
  found = ttq.targets(ssgd)
  # The worst seed's loss at the last step, and at the step nearest half
  # of it (200), so that S-SGD reaches each in every seed.
  assert found == {"ssgd_final": (400, 1.3), "ssgd_half": (200, 2.2)}
  for _, loss in found.values():
    assert all(ttq.steps_to(c, loss) < math.inf for c in ssgd.values())


def test_targets_need_a_step_every_seed_evaluated():
  with pytest.raises(ValueError, match="no evaluation step"):
    ttq.targets({0: {100: 1.0}, 1: {200: 1.0}})


def test_composition_prices_a_dense_warm_up_apart():
  assert ttq.composed(400, 1.0) == 400.0
  # 60 dense steps at 2 s, then 340 at 0.5 s.
  assert ttq.composed(400, 0.5, warmup=60, dense=2.0) == 290.0
  # A target reached within the warm-up: every step dense.
  assert ttq.composed(50, 0.5, warmup=60, dense=2.0) == 100.0
  # ... whatever the compressed step's time, unknown there.
  assert ttq.composed(50, math.nan, warmup=60, dense=2.0) == 100.0
  assert ttq.composed(math.inf, 0.5, warmup=60, dense=2.0) == math.inf


def test_phase_step_times_leave_out_compilation_and_the_switch():
  # Evaluations every 25 steps, 60 dense: 25 -> 50 is dense (2 s a step),
  # 50 -> 75 spans the switch, 75 -> 100 and 100 -> 125 are compressed.
  curve = [(25, 70.0), (50, 120.0), (75, 150.0), (100, 162.5), (125, 175.0)]
  assert ttq.phase_step_seconds(curve, 60) == (2.0, 0.5)
  dense, compressed = ttq.phase_step_seconds(curve[:2], 60)
  assert dense == 2.0 and math.isnan(compressed)
  # Without a warm-up every interval but the first is compressed.
  dense, compressed = ttq.phase_step_seconds(curve, 0)
  assert math.isnan(dense) and compressed == (1.2 + 0.5) / 2


def test_a_composed_time_agrees_only_within_the_threshold_either_way():
  tol = thresholds.COMPOSED_VS_DIRECT
  assert ttq.agrees(100.0, 100.0)
  assert ttq.agrees(100.0 * (1 + tol) * 0.999, 100.0)
  assert ttq.agrees(100.0 * (1 - tol) * 1.001, 100.0)
  assert not ttq.agrees(100.0 * (1 + tol) * 1.01, 100.0)  # too slow
  assert not ttq.agrees(100.0 * (1 - tol) * 0.99, 100.0)  # too fast
  assert not ttq.agrees(math.inf, 100.0)  # never reached
  assert not ttq.agrees(100.0, 0.0)


def _records(task, variant, seed, losses, bytes_per_step):
  return [
      {
          "task": task,
          "variant": variant,
          "seed": seed,
          "step": step,
          "eval_loss": loss,
          "bytes_sent": step * bytes_per_step,
      }
      for step, loss in losses.items()
  ] + [{  # a train line, without a held-out loss
      "task": task, "variant": variant, "seed": seed, "step": 1,
      "eval_loss": None, "bytes_sent": bytes_per_step,
  }]


def test_the_table_gives_steps_and_bytes_to_each_target_per_seed():
  records = [
      *_records("t", "ssgd", 0, {10: 3.0, 20: 2.0, 30: 1.0, 40: 0.9}, 100),
      *_records("t", "ssgd", 1, {10: 3.0, 20: 2.1, 30: 1.1, 40: 0.8}, 100),
      *_records("t", "acp", 0, {10: 2.9, 20: 2.0, 30: 1.5, 40: 1.2}, 10),
      *_records("t", "acp", 1, {10: 2.9, 20: 2.2, 30: 1.4, 40: 0.85}, 10),
      *_records("other", "acp", 0, {10: 0.1}, 10),
  ]
  rows = {(r["target"], r["variant"]): r for r in ttq.table(records, "t")}
  final = rows["ssgd_final", "ssgd"]
  assert final["target_loss"] == 0.9 and final["ssgd_step"] == 40
  assert final["steps"] == ttq.Span(40.0, 40, 40) and final["reached"] == 2
  acp = rows["ssgd_final", "acp"]
  assert acp["reached"] == 1 and acp["steps"].high == math.inf
  assert acp["bytes"].low == 400  # seed 1's 40 steps of 10 bytes
  half = rows["ssgd_half", "acp"]  # S-SGD's worst at step 20: 2.1
  assert half["steps"] == ttq.Span(25.0, 20, 30)
  assert half["bytes"] == ttq.Span(250.0, 200, 300)
  assert ttq.table(records, "missing") == []
