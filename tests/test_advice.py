"""The advice: which compressor, at which rank, for a model on a link."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax import registry
from acp_jax_tools import advice as advice_lib
from acp_jax_tools import calibration as calibration_lib
from acp_jax_tools import costmodel
from acp_jax_tools import measure as measure_lib
from acp_jax_tools import candidates as candidates_lib
from acp_jax_tools import simulated
from acp_jax_tools import steps as steps_lib
from tests.test_train import small_config
from train import advice as train_advice
from train import train

WORKERS = 4
CANDIDATES = (
    advice_lib.Candidate("ssgd"),
    advice_lib.Candidate("power_sgd", 1),
    advice_lib.Candidate("power_sgd", 4),
    advice_lib.Candidate("acp_sgd", 1),
    advice_lib.Candidate("acp_sgd", 4),
)
THRESHOLD = advice_lib.Calibration.recorded().error_to_noise

# Errors on both sides of the threshold (acp_sgd_r1 beyond it).
ERRORS = {
    "ssgd": 0.0,
    "power_sgd_r1": 0.8 * THRESHOLD,
    "power_sgd_r4": 0.2 * THRESHOLD,
    "acp_sgd_r1": 2 * THRESHOLD,
    "acp_sgd_r4": 0.5 * THRESHOLD,
}
MEASURED = advice_lib.Measurements(
    forward_backward=0.01,
    update={
        "ssgd": 1e-4,
        "power_sgd_r1": 2e-3,
        "power_sgd_r4": 3e-3,
        "acp_sgd_r1": 1e-3,
        "acp_sgd_r4": 2e-3,
    },
    error_to_noise=ERRORS,
)


def _mlp():
  rng = np.random.default_rng(0)
  params = {
      "w1": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32) / 4,
      "w2": jnp.asarray(rng.standard_normal((32, 8)), jnp.float32) / 6,
  }

  def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

  batches = [
      {
          "x": rng.standard_normal((8, 16)).astype(np.float32),
          "y": rng.standard_normal((8, 8)).astype(np.float32),
      }
      for _ in range(3)
  ]
  return loss_fn, params, batches


def _advise(
    link,
    measurements=MEASURED,
    workers=WORKERS,
    candidates=CANDIDATES,
    **kwargs,
):
  loss_fn, params, batches = _mlp()
  return acp_jax.advise(
      loss_fn,
      params,
      batches,
      workers=workers,
      link=link,
      candidates=candidates,
      measurements=measurements,
      **kwargs,
  )


def test_the_advice_is_the_same_for_the_same_measurements():
  link = advice_lib.Link(bandwidth=1e7, latency=1e-4)
  first, second = _advise(link), _advise(link)
  assert first.to_record() == second.to_record()
  assert first.table() == second.table()
  # Each row is the cost model's step on comm_bytes' traffic.
  _, params, _ = _mlp()
  row = next(r for r in first.rows if r.candidate.name == "acp_sgd_r4")
  volumes = acp_jax.comm_bytes(
      advice_lib.Candidate("acp_sgd", 4).make(), params, num_devices=WORKERS
  )
  steps = [
      costmodel.step_seconds(
          0.01 + 2e-3,
          costmodel.BACKWARD_SHARE * 0.01,
          t,
          "acp_sgd",
          WORKERS,
          link.costs(),
          overlap=False,
      )
      for t in costmodel.traffic(volumes, "acp_sgd")
  ]
  assert row.step_s == pytest.approx(np.mean(steps))
  assert row.examples_per_s == pytest.approx(8 / np.mean(steps))
  # Fastest first; the pick the fastest within the threshold.
  assert [r.step_s for r in first.rows] == sorted(r.step_s for r in first.rows)
  threshold = first.calibration.error_to_noise
  assert first.pick == next(
      r for r in first.rows if r.error_to_noise <= threshold
  )
  assert f"error/noise <= {threshold:.3f}" in first.table()


def test_a_free_link_picks_ssgd():
  advice = _advise(advice_lib.Link(bandwidth=math.inf, latency=0.0))
  assert advice.pick.candidate == advice_lib.Candidate("ssgd")
  assert all(r["bandwidth"] is None for r in advice.to_record())


def test_a_slow_link_picks_the_fewest_bytes_within_the_threshold():
  advice = _advise(advice_lib.Link(bandwidth=1e3, latency=1e-3))
  admits = advice.calibration.admits
  within = [r for r in advice.rows if admits(r.error_to_noise)]
  assert len(within) < len(advice.rows)  # the threshold turns one away
  assert advice.pick == min(within, key=lambda r: r.bytes_per_step)
  # The fewest bytes of all is beyond the threshold, and not picked.
  fewest = min(advice.rows, key=lambda r: r.bytes_per_step)
  assert fewest.error_to_noise > THRESHOLD and advice.pick != fewest
  assert isinstance(advice.compressor(), acp_jax.Compressor)
  assert advice.compressor().made_by == advice.pick.candidate.make().made_by


def test_the_threshold_is_the_records_highest_error_within_the_gap():
  points = [
      calibration_lib.CalibrationPoint("a", 0.1, 0.99, 0.02),
      calibration_lib.CalibrationPoint("b", 0.5, 0.98, 0.06),
      calibration_lib.CalibrationPoint("c", 0.8, 0.97, 0.04),
      calibration_lib.CalibrationPoint("d", 2.0, 0.90, 0.20),
  ]
  at = lambda gap: advice_lib.Calibration.from_points(
      points, gap, ""
  ).error_to_noise
  assert at(0.10) == 0.8
  assert at(0.05) == 0.1  # b at 6 % stops the walk up
  assert at(0.01) == 0.0  # none within: S-SGD alone
  recorded = advice_lib.Calibration.recorded()
  assert recorded.points and recorded.max_gap == calibration_lib.MAX_GAP


def test_the_shipped_calibration_is_the_records():
  from benchmarks import advise
  from benchmarks import records

  shipped = os.path.join(
      os.path.dirname(advice_lib.__file__), calibration_lib.CALIBRATION_FILE
  )
  with open(shipped) as f:
    calibration = json.load(f)
  # Its errors were measured as the advice measures them now, on the
  # recorded variants, whose loss gaps it holds.
  measurement = advise.calibration_measurement()
  assert calibration["measurement"] == measurement
  assert measurement["warmup"] == advice_lib.WARMUP
  assert measurement["steps"] == advice_lib.STEPS
  runs = advise.calibration_runs(records.RESULTS_DIR)
  assert runs
  assert calibration["source"] == advise.calibration_source(runs, measurement)
  points = calibration["points"]
  assert [(p["variant"], p["run"], p["gap"]) for p in points] == [
      (r["variant"], r["run"], r["gap"]) for r in runs
  ]
  assert all(0 < p["cosine"] <= 1 for p in points)
  assert all(p["error_to_noise"] > 0 for p in points)


def test_update_times_between_the_timed_ranks_are_interpolated():
  assert measure_lib.timed_ranks(candidates_lib.RANKS) == (1, 8, 32)
  assert measure_lib.timed_ranks((4, 1)) == (1, 4)
  _, params, _ = _mlp()
  candidates = [advice_lib.Candidate("power_sgd", r) for r in (1, 2, 4, 8)]
  lines = []
  times = measure_lib._update_times(candidates, params, 1, lines.append)
  assert lines == [f"update of power_sgd_r{r}" for r in (1, 4, 8)]
  r1, r4 = times["power_sgd_r1"], times["power_sgd_r4"]
  assert times["power_sgd_r2"] == pytest.approx(r1 + (r4 - r1) / 3)


def test_measured_errors_order_the_ranks_and_ssgd_is_fastest_unshaped():
  loss_fn, params, batches = _mlp()
  candidates = CANDIDATES[:3]
  measured = advice_lib.measure(
      loss_fn, params, batches, candidates, workers=WORKERS, repeats=1
  )
  assert measured.cosine["ssgd"] == 1.0
  assert measured.error_to_noise["ssgd"] == 0.0
  # Rank 4 keeps more of the mean than rank 1; neither is exact.
  errors, cosines = measured.error_to_noise, measured.cosine
  assert errors["power_sgd_r1"] > errors["power_sgd_r4"] > 0
  assert cosines["power_sgd_r1"] < cosines["power_sgd_r4"] < 1.0
  assert measured.forward_backward > 0
  assert all(t > 0 for t in measured.update.values())


def test_errors_are_measured_fastest_first_until_one_is_within():
  loss_fn, params, batches = _mlp()
  batches = batches + batches[:1]  # the calibration's STEPS
  candidates = CANDIDATES[:3]
  link = advice_lib.Link(bandwidth=1e3, latency=1e-3)
  kwargs = dict(workers=WORKERS, link=link, candidates=candidates)
  everything = acp_jax.advise(
      loss_fn, params, batches, measure_all=True, **kwargs
  )
  lazy = acp_jax.advise(loss_fn, params, batches, **kwargs)
  assert set(everything.measurements.error_to_noise) == {
      c.name for c in candidates
  }
  # The same pick; the candidates after it, slower, are not measured.
  assert lazy.pick.candidate == everything.pick.candidate
  after = lazy.rows[lazy.rows.index(lazy.pick) + 1 :]
  assert after and all(r.error_to_noise is None for r in after)
  assert lazy.pick.error_to_noise == everything.pick.error_to_noise
  assert lazy.table().count(" - ") >= len(after)
  # A faster candidate left unmeasured cannot be passed over.
  fast = next(r for r in everything.rows).candidate.name
  partial = advice_lib.Measurements(
      MEASURED.forward_backward,
      MEASURED.update,
      {n: e for n, e in ERRORS.items() if n != fast},
  )
  with pytest.raises(ValueError, match=f"{fast} is predicted faster"):
    _advise(link, measurements=partial, candidates=candidates)


def test_the_sampling_noise_is_the_variance_of_the_mean():
  rng = np.random.default_rng(1)
  workers, size, sigma = 4, 20_000, 0.5
  center = rng.standard_normal(size)
  stacked = {"g": jnp.asarray(center + sigma * rng.standard_normal(
      (workers, size)), jnp.float32)}
  noise = float(simulated.sampling_noise(stacked))
  # Each coordinate's mean of 4 draws has variance sigma^2 / 4.
  assert noise == pytest.approx(size * sigma**2 / workers, rel=0.03)
  # Equal gradients carry none; one device's mean has none to estimate.
  same = {"g": jnp.broadcast_to(jnp.asarray(center), (workers, size))}
  assert float(simulated.sampling_noise(same)) == 0.0
  assert float(simulated.sampling_noise({"g": stacked["g"][:1]})) == 0.0
  assert measure_lib._ratio(0.0, 0.0) == 0.0
  assert measure_lib._ratio(1.0, 0.0) == math.inf


def test_a_measurement_over_other_steps_than_the_calibrations_warns():
  loss_fn, params, batches = _mlp()
  assert len(batches) != advice_lib.STEPS
  with pytest.warns(UserWarning, match="threshold was calibrated"):
    acp_jax.advise(
        loss_fn,
        params,
        batches,
        workers=WORKERS,
        link=advice_lib.Link(1e6),
        candidates=CANDIDATES[:1],
    )


def test_candidates_send_bfloat16_factors_off_the_cpu_only():
  on_cpu = advice_lib.default_candidates("cpu")
  on_gpu = advice_lib.default_candidates("gpu")
  assert not any(c.comm_dtype for c in on_cpu)
  ranks = candidates_lib.RANKS
  assert {c.name for c in on_gpu} - {c.name for c in on_cpu} == {
      f"{m}_r{r}_bf16" for m in registry.low_rank() for r in ranks
  }
  assert len(on_cpu) == 3 + 2 * len(ranks)


def test_a_candidate_without_a_rank_takes_its_registry_entrys_config():
  """Types in an entry's config stand for the factory's defaults: left
  out; Top-k keeps the configs' density."""
  density = registry.get("topk_sgd").config["density"]
  topk = advice_lib.Candidate("topk_sgd")
  assert topk.kwargs() == {"density": density}
  assert topk.make() == acp_jax.topk_sgd(density)
  assert advice_lib.Candidate("ssgd").make() == acp_jax.ssgd()
  assert advice_lib.Candidate("acp_sgd", 4, "bfloat16").make() == (
      acp_jax.acp_sgd(4, comm_dtype="bfloat16")
  )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _advise(advice_lib.Link(1e6), workers=0), "workers must"),
        (lambda: advice_lib.Link(bandwidth=-1.0), "bandwidth must be"),
        (lambda: advice_lib.Link(bandwidth=1e6, latency=-1), "latency must"),
        (lambda: advice_lib.Candidate("power_sgd"), "rank is for"),
        (lambda: advice_lib.Candidate("lion"), "method"),
        (lambda: _advise(advice_lib.Link(1e6), max_gap=-0.1), "max_gap"),
    ],
)
def test_bad_inputs_name_the_argument(call, message):
  with pytest.raises((ValueError, TypeError)) as e:
    call()
  assert message in str(e.value)


def test_bad_inputs_name_the_value():
  with pytest.raises(ValueError, match=r"workers must .*got 0"):
    _advise(advice_lib.Link(1e6), workers=0)
  with pytest.raises(ValueError, match=r"bandwidth .* got -1.0"):
    advice_lib.Link(bandwidth=-1.0)
  with pytest.raises(ValueError, match=r"method .*'lion'"):
    advice_lib.Candidate("lion")
  with pytest.raises(ValueError, match=r"rank .* got rank 4 for 'ssgd'"):
    advice_lib.Candidate("ssgd", 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt9"], "argument --model: invalid choice: 'gpt9'"),
        (["--bandwidth", "-1"], "argument --bandwidth: bandwidth must be a"),
        (["--workers", "0"], "argument --workers: must be comma-separated"),
    ],
)
def test_the_cli_names_a_bad_argument(argv, message, capsys):
  from benchmarks import __main__ as cli_main

  with pytest.raises(SystemExit):
    cli_main.main(["advise", *argv])
  assert message in capsys.readouterr().err


def test_the_cli_pairs_each_bandwidth_with_a_latency():
  from benchmarks import __main__ as cli_main

  argv = ["advise", "--task", "mnist", "--workers", "2"]
  with pytest.raises(SystemExit, match="3 values for 2 bandwidths"):
    cli_main.main([*argv, "--bandwidth", "1e6,1e7", "--latency", "0,0,1"])
  with pytest.raises(SystemExit, match="give --bandwidth"):
    cli_main.main(argv)


def test_calibrate_needs_the_text_it_measures_on():
  from benchmarks import __main__ as cli_main

  with pytest.raises(SystemExit, match="give --char_lm_path"):
    cli_main.main(["advise", "--calibrate"])


def _write_advice(path, candidates):
  advice = _advise(
      advice_lib.Link(bandwidth=1e3, latency=1e-3), candidates=candidates
  )
  with open(path, "w") as f:
    json.dump(advice.to_record(), f)
  return advice.pick.candidate


def _checkpoint_settings(workdir):
  steps = os.listdir(os.path.join(workdir, "checkpoints"))
  latest = os.path.join(workdir, "checkpoints", max(steps, key=int))
  with open(os.path.join(latest, "record", "metadata")) as f:
    return json.load(f)["settings"]


def test_auto_trains_with_the_pick_saves_it_and_a_resume_keeps_it(
    tmp_path, capsys
):
  workdir = str(tmp_path / "run")
  first, other = tmp_path / "first.json", tmp_path / "other.json"
  ssgd, power_r1, power_r4 = CANDIDATES[:3]
  assert _write_advice(first, (ssgd, power_r4)) == power_r4
  assert _write_advice(other, (ssgd, power_r1)) == power_r1
  config = small_config("auto", steps=2, checkpoint_every_steps=2)
  config.compressor.auto.advice = str(first)
  config.compressor.auto.workers = WORKERS
  summary = train.train_and_evaluate(config, workdir)
  assert summary["compressor"] == "power_sgd"
  assert "recommended: power_sgd_r4" in capsys.readouterr().out
  saved = _checkpoint_settings(workdir)["advice"]
  assert saved["name"] == "power_sgd_r4"
  assert saved["threshold"] == THRESHOLD
  # A resume given an advice of another pick is refused, naming both.
  config.num_train_steps = 4
  config.compressor.auto.advice = str(other)
  with pytest.raises(ValueError, match="picks power_sgd_r1.*power_sgd_r4"):
    train.train_and_evaluate(config, workdir)
  # Without one it reuses the saved advice and measures nothing.
  config.compressor.auto.advice = None
  summary = train.train_and_evaluate(config, workdir)
  assert summary["step"] == 4 and summary["compressor"] == "power_sgd"
  assert _checkpoint_settings(workdir)["advice"]["name"] == "power_sgd_r4"


def test_auto_without_a_link_or_an_advice_names_the_setting(tmp_path):
  config = small_config("auto", steps=1)
  with pytest.raises(ValueError, match="config.compressor.auto.bandwidth"):
    train_advice.resolve(config, str(tmp_path))




def test_the_report_checks_the_advice_at_a_measured_point():
  from benchmarks import advice_check

  measured = {"ssgd": 2.0, "power_sgd": 9.0, "acp_sgd": 10.0}  # examples/s
  point = [
      {
          "model": "tiny",
          "workers": 2,
          "bandwidth": "10mbit",
          "compressor": c,
          "step_local_s": 0.1,
          "examples_per_sec": speed,
      }
      for c, speed in measured.items()
  ]
  row = advice_check.advice_at(
      point,
      {"alpha_s": 1e-4, "beta_s_per_byte": 1e-6},  # 1 MB/s
      {"ssgd": 0.0, "power_sgd_r4": THRESHOLD / 2, "acp_sgd_r4": 2 * THRESHOLD},
      advice_check.cluster_params("tiny"),
  )
  # ACP-SGD measured fastest but beyond the threshold: the advice is the
  # fastest within it, Power-SGD.
  assert row["advised"] == row["best_eligible"] == "power_sgd_r4"
  assert row["best"] == "acp_sgd_r4"
  assert row["ratio"] == pytest.approx(0.9)
  assert row["eligible_ratio"] == 1.0
  # Where S-SGD was not measured and neither low-rank method is within
  # the threshold, nothing is advised.
  low = advice_check.advice_at(
      point[1:],
      {"alpha_s": 1e-4, "beta_s_per_byte": 1e-6},
      {"power_sgd_r4": 2 * THRESHOLD, "acp_sgd_r4": 2 * THRESHOLD},
      advice_check.cluster_params("tiny"),
  )
  assert low["advised"] == "none within the threshold"
  assert low["best"] == "acp_sgd_r4" and "ratio" not in low


def test_candidates_predicted_within_the_tie_pick_the_least_error():
  """Power-SGD at rank r and ACP-SGD at 2r send the same bytes: their
  predicted steps differ by their updates' timing noise, which picked
  either. Within TIE of the fastest within the threshold, the least
  error is picked, and measured before the advice stops."""
  link = advice_lib.Link(bandwidth=1e4, latency=0.0)
  candidates = (
      advice_lib.Candidate("ssgd"),
      advice_lib.Candidate("power_sgd", 1),
      advice_lib.Candidate("acp_sgd", 2),
  )
  update = {"ssgd": 1e-4, "power_sgd_r1": 2.0e-3, "acp_sgd_r2": 1.9e-3}
  errors = {"ssgd": 0.0, "power_sgd_r1": 0.3 * THRESHOLD,
            "acp_sgd_r2": 0.6 * THRESHOLD}
  measured = advice_lib.Measurements(0.01, update, errors)
  advice = _advise(link, measurements=measured, candidates=candidates)
  fastest, second = advice.rows[:2]
  assert fastest.candidate.name == "acp_sgd_r2"
  assert second.step_s <= fastest.step_s * (1 + advice_lib.TIE)
  assert advice.pick is second
  assert "of least error" in advice.table()
  # Beyond the tie, the fastest within the threshold.
  slower = {**update, "power_sgd_r1": 0.5}
  advice = _advise(
      link,
      measurements=advice_lib.Measurements(0.01, slower, errors),
      candidates=candidates,
  )
  assert advice.pick.candidate.name == "acp_sgd_r2"
  assert "the fastest within the threshold" in advice.table()
  # The tied candidate's error is needed: without it, no advice.
  partial = advice_lib.Measurements(
      0.01, update, {n: e for n, e in errors.items() if n != "power_sgd_r1"}
  )
  with pytest.raises(ValueError, match="power_sgd_r1 is predicted faster"):
    _advise(link, measurements=partial, candidates=candidates)


def _stretched(factor, evals=21):
  """Held-out losses at ``evals`` evenly spaced steps, descending
  ``factor`` times slower than ``_stretched(1)``: its loss at step ``s``
  is the latter's at ``s / factor``."""
  return [3.0 - 0.5 * math.log1p(s / factor) for s in range(evals)]


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0, 3.5])
def test_steps_behind_reads_a_slower_descent_as_its_steps_ratio(factor):
  got = steps_lib.steps_behind(_stretched(factor), _stretched(1.0))
  assert got == pytest.approx(factor, rel=0.02)


def test_steps_behind_limit_cases():
  reference = _stretched(1.0)
  # Ahead of the reference: no fewer steps than it.
  assert steps_lib.steps_behind(_stretched(0.5), reference) == 1.0
  # Above everywhere the reference has been: it never came down to there.
  assert steps_lib.steps_behind([3.5] * 21, reference) == math.inf
  # A reference that climbs back is read at its best loss so far.
  bumpy = reference[:10] + [reference[10] + 0.2] + reference[11:]
  assert steps_lib.steps_behind(_stretched(2.0), bumpy) == pytest.approx(
      2.0, rel=0.05
  )
  # One evaluation's noise moves the steps less than the level's share.
  noisy = _stretched(2.0)
  noisy[-1] += 0.05
  assert steps_lib.steps_behind(noisy, reference) == pytest.approx(
      2.0, rel=0.2
  )
  with pytest.raises(ValueError, match="same steps, at least 5, got 4 and 5"):
    steps_lib.steps_behind([1.0] * 4, [1.0] * 5)


def test_a_short_run_of_ssgd_is_plain_training_on_the_mean_gradient():
  loss_fn, params, batches = _mlp()
  optimizer = optax.sgd(0.1, momentum=0.9)
  held_out = batches[:2]
  got = measure_lib.run_losses(
      loss_fn,
      params,
      batches,
      held_out,
      advice_lib.Candidate("ssgd"),
      optimizer,
      workers=2,
      every=1,
  )
  # The plain loop: the mean of the two workers' gradients.
  held_out_loss = lambda p: np.mean([loss_fn(p, b) for b in held_out])
  state = optimizer.init(params)
  want = [held_out_loss(params)]
  for batch in batches:
    halves = [
        jax.tree.map(lambda x: x[i * 4 : (i + 1) * 4], batch) for i in (0, 1)
    ]
    grads = [jax.grad(loss_fn)(params, h) for h in halves]
    mean = jax.tree.map(lambda *g: sum(g) / 2, *grads)
    updates, state = optimizer.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    want.append(held_out_loss(params))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_measured_steps_rank_by_the_time_to_the_loss():
  link = advice_lib.Link(bandwidth=1e3, latency=1e-3)
  by_step = _advise(link)
  # The pick of the fastest step, made to need a hundred times S-SGD's
  # steps, loses to the next within the threshold.
  steps = {r.candidate.name: 1.0 for r in by_step.rows}
  steps[by_step.pick.candidate.name] = 100.0
  advice = _advise(link, dataclasses.replace(MEASURED, steps=steps))
  assert [r.seconds for r in advice.rows] == sorted(
      r.step_s * steps[r.candidate.name] for r in advice.rows
  )
  assert advice.pick != by_step.pick
  assert advice.pick == next(
      r for r in advice.rows if r.error_to_noise <= THRESHOLD
  )
  assert advice.pick.steps == 1.0


def test_short_runs_name_a_bad_argument():
  _, _, batches = _mlp()
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="at least 8 batches, got 3"):
    steps_lib.ShortRuns(sgd, batches, batches)
  with pytest.raises(ValueError, match="eval_batches must hold at least one"):
    steps_lib.ShortRuns(sgd, batches * 3, [])
  with pytest.raises(ValueError, match="repeats must be a positive int"):
    steps_lib.ShortRuns(sgd, batches * 3, batches, repeats=0)


def test_the_advice_with_short_runs_measures_and_records_their_steps():
  loss_fn, params, batches = _mlp()
  run = batches * 3  # 9 steps
  advice = acp_jax.advise(
      loss_fn,
      params,
      run[: advice_lib.STEPS],
      workers=2,
      link=advice_lib.Link(bandwidth=1e4),
      candidates=CANDIDATES[:3],
      short_runs=steps_lib.ShortRuns(optax.sgd(0.1), run, batches[:1]),
  )
  by_name = {r.candidate.name: r for r in advice.rows}
  assert by_name["ssgd"].steps == 1.0
  assert all(r.steps >= 1.0 for r in advice.rows)
  record = advice.to_record()
  assert {r["run_steps"] for r in record} == {9}
  assert advice_lib.Row.from_dict(record[0]) == advice.rows[0]
  assert "9-step runs (the median of 1)" in advice.table()


def test_the_trainers_short_run_is_shuffled_training_and_held_out_batches():
  config = small_config("ssgd")
  *_, none = train_advice.inputs(config, WORKERS, 4)
  assert none is None
  loss_fn, params, first, run = train_advice.inputs(
      config, WORKERS, 4, run_steps=steps_lib.RUN_STEPS_MIN, run_repeats=2
  )
  assert len(first) == 4 and len(run.batches) == steps_lib.RUN_STEPS_MIN
  assert run.repeats == 2
  assert len(run.eval_batches) == train_advice.EVAL_BATCHES
  # Shuffled by the config's seed: not the training split's first rows.
  assert not np.array_equal(first[0]["inputs"], run.batches[0]["inputs"])
  again = train_advice.inputs(config, WORKERS, 4, run_steps=8)[3]
  np.testing.assert_array_equal(
      again.batches[3]["inputs"], run.batches[3]["inputs"]
  )
  # The config's optimizer: a step of it moves the params.
  state = run.optimizer.init(params)
  grads = jax.grad(loss_fn)(params, run.batches[0])
  updates, _ = run.optimizer.update(grads, state, params)
  assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates))


def test_repeated_short_runs_take_the_median_of_other_orders(monkeypatch):
  loss_fn, params, batches = _mlp()
  orders = []
  real = measure_lib.run_losses

  def recorded(loss_fn, params, batches, *args, **kwargs):
    orders.append([float(b["x"][0, 0]) for b in batches])
    return real(loss_fn, params, batches, *args, **kwargs)

  monkeypatch.setattr(steps_lib, "run_losses", recorded)
  run = batches * 3
  steps, steps_range = steps_lib.ShortRuns(
      optax.sgd(0.1), run, batches[:1], repeats=3
  ).measure(loss_fn, params, CANDIDATES[1:3], workers=2)
  assert steps["ssgd"] == 1.0 and len(steps) == 3
  assert steps_range["ssgd"] == (1.0, 1.0)
  assert all(lo <= steps[n] <= hi for n, (lo, hi) in steps_range.items())
  # Three orders of three runs each: the given one first, then two others.
  assert len(orders) == 9
  assert orders[0] == [float(b["x"][0, 0]) for b in run]
  assert orders[3] != orders[0] and orders[6] not in (orders[0], orders[3])
  assert sorted(orders[3]) == sorted(orders[0])


def test_steps_whose_short_runs_overlap_tie_and_the_lower_error_wins():
  def row(name, step_s, steps, low, high):
    method, _, rank = name.partition("_r")
    return advice_lib.Row(
        advice_lib.Candidate(method, int(rank)),
        step_s, 1 / step_s, 1.0, 0.0, ERRORS[name], None, steps, low, high,
    )

  calibration = advice_lib.Calibration.recorded()
  # acp_sgd_r4 is 10 % sooner by the medians, beyond TIE, but its runs'
  # spread reaches power_sgd_r4's: a tie, which the lower error breaks.
  acp = row("acp_sgd_r4", 1.0, 1.0, 0.9, 1.2)
  power = row("power_sgd_r4", 1.0, 1.1, 1.05, 1.3)
  assert power.ties(acp) and not power.seconds <= acp.seconds * 1.02
  assert advice_lib.choose([acp, power], ERRORS, calibration)[0] == power
  # Runs that do not overlap: the sooner one.
  apart = row("power_sgd_r4", 1.0, 1.5, 1.4, 1.6)
  assert not apart.ties(acp)
  assert advice_lib.choose([acp, apart], ERRORS, calibration)[0] == acp
