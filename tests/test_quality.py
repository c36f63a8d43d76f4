"""Time to quality on the shaped link: the records of a run's rounds, the
targets named from S-SGD's simulated curves, and a 2-worker run."""

import json
import math

import pytest

from benchmarks import links
from benchmarks import quality
from benchmarks import records
from tests import helpers


def _round(target_step, train_seconds, first=(4, 10.0), per_second=64.0):
  return {
      "global_batch": 32,
      "summary": {
          "target_step": target_step,
          "train_seconds": train_seconds,
          "examples_per_sec": per_second,  # 0.5 s a step
          "bytes_sent": 1000 * (target_step or 24),
      },
      "curve": [{"step": first[0], "eval_loss": 3.0,
                 "train_seconds": first[1]}],
  }


def test_a_record_gives_each_round_and_leaves_the_start_up_out():
  rounds = [_round(8, 12.0), _round(12, 14.0), _round(None, 20.0)]
  r = quality.record(rounds, 2.5, None)
  assert r["reached"] == "2/3" and r["steps"] == 12
  # The capped round counts as never reaching the target.
  assert records.runs(r, "train_seconds") == [12.0, 14.0, None]
  # 4 steps at 0.5 s took 10 s: 8 s of start-up left out of each round.
  assert records.runs(r, "steady_seconds") == [4.0, 6.0, None]
  assert r["step_s"] == 0.5 and "composed_seconds" not in r


def test_a_record_that_never_reached_its_target_is_written(tmp_path):
  """A round capped before the target, and a simulated curve that never
  reached it, made infinite fields, which records.write refuses: a sweep's
  records were lost at its end."""
  never = {0: {4: 3.0, 8: 2.9}}
  r = quality.record([_round(None, 20.0), _round(8, 12.0)], 2.5, never)
  assert r["composed_seconds"] is None and r["train_seconds_run1"] is None
  assert r["composed_steps_seed0"] is None
  # No composed time, so no check of one: neither agreeing nor not.
  assert r["composed_agrees"] is None
  records.write("quality", [r], tmp_path)
  assert records.read("quality", tmp_path) == [r]


def test_a_record_composes_simulated_steps_with_the_step_time():
  simulated = {0: {4: 3.0, 8: 2.4}, 1: {4: 2.9, 8: 2.6, 12: 2.4}}
  r = quality.record([_round(8, 12.0), _round(8, 12.0)], 2.5, simulated)
  # Steps to 2.5: 8 and 12, median 10, at 0.5 s a step.
  assert (r["composed_steps_seed0"], r["composed_steps_seed1"]) == (8, 12)
  assert r["composed_steps"] == 10
  assert r["composed_seconds"] == 5.0
  assert r["steady_seconds"] == 4.0 and not r["composed_agrees"]  # 25 %
  r = quality.record([_round(8, 13.0), _round(8, 13.0)], 2.5, simulated)
  assert r["composed_agrees"]  # 5.0 against 5.0


def test_each_round_composes_the_steps_of_its_own_seed():
  """Every method of a round trains the round's seed: its composed time
  takes that seed's simulated steps, the median where it was not
  simulated."""
  simulated = {0: {4: 3.0, 8: 2.4}, 1: {4: 2.9, 8: 2.6, 12: 2.4}}
  rounds = [_round(12, 14.0), _round(8, 12.0), _round(8, 12.0)]
  r = quality.record(rounds, 2.5, simulated, seeds=[1, 0, 5])
  assert records.runs(r, "seed") == [1, 0, 5]
  # 12, 8 and the median 10 steps, at 0.5 s a step.
  assert records.runs(r, "composed_seconds") == [6.0, 4.0, 5.0]
  assert r["composed_steps"] == 10
  # Each round's steps to the target beside their median.
  assert records.runs(r, "steps") == [12, 8, 8] and r["steps"] == 8
  # Rounds of unknown seeds all take the median.
  r = quality.record(rounds, 2.5, simulated)
  assert records.runs(r, "composed_seconds") == [5.0, 5.0, 5.0]


def test_the_report_says_which_seeds_the_rounds_trained():
  from benchmarks import report_quality

  old = _quality_row("ssgd", "10mbit", [1.0, 2.0])
  assert "every round trained seed 0" in report_quality.seeds_said(
      [{**old, "seed": 0}]
  )
  seeds = {"seed_run1": 0, "seed_run2": 1, "seed_run3": 2}
  assert report_quality.seeds_said([{**old, **seeds}]) == (
      "rounds trained seeds 0, 1, 2"
  )


def test_a_warmed_record_composes_each_phase_at_its_own_step_time():
  """4 dense steps, then compressed ones: its mean step time mixes the two,
  so the rule reads each phase's from the round's curve."""
  simulated = {0: {4: 3.0, 8: 2.6, 12: 2.4}}  # 12 steps to 2.5
  curve = [(2, 5.0), (4, 7.0), (6, 8.0), (8, 8.5), (10, 9.0), (12, 9.5)]
  rounds = [
      {**_round(12, 9.5, per_second=128.0), "curve": [
          {"step": s, "eval_loss": 3.0, "train_seconds": t} for s, t in curve
      ]}
      for _ in range(2)
  ]
  r = quality.record(rounds, 2.5, simulated, warmup=4)
  # 4 steps at 1 s, 8 at 0.25 s; not 12 at its mean step (0.25 s), 3 s.
  assert r["composed_seconds"] == 6.0 and r["composed_warmup"] == 4
  assert records.runs(r, "composed_seconds") == [6.0, 6.0]
  # The start-up: its first 2 steps took 5 s, 2 of them at a dense step's
  # 1 s (at the mean step, 4.5 s, and the steady time 5 s, would disagree).
  assert r["steady_seconds"] == 6.5 and r["composed_agrees"]
  # Reached within the warm-up, with one evaluation: no phase has an
  # interval of its own, and the start-up is taken at the mean step.
  early = {**_round(4, 7.0), "curve": [
      {"step": 4, "eval_loss": 2.4, "train_seconds": 6.0}
  ]}
  r = quality.record([early], 2.5, None, warmup=8)
  assert r["steady_seconds"] == 3.0


def test_a_named_target_comes_from_the_curves_at_as_many_devices(tmp_path):
  def final(variant, seed, devices):
    return {"task": "char_lm", "variant": variant, "seed": seed,
            "num_devices": devices}

  def point(variant, seed, step, loss):
    return {"task": "char_lm", "variant": variant, "seed": seed,
            "step": step, "eval_loss": loss, "bytes_sent": step}

  records.write(
      "convergence",
      [final("ssgd", 0, 2), final("ssgd", 1, 8)],
      tmp_path,
  )
  records.write(
      "convergence_curves",
      [point("ssgd", 0, 10, 3.0), point("ssgd", 0, 20, 2.0),
       point("ssgd", 1, 10, 9.0), point("ssgd", 1, 20, 9.0)],
      tmp_path,
  )
  curves = quality.simulated_curves(tmp_path, "char_lm", 2)
  assert curves == {"ssgd": {0: {10: 3.0, 20: 2.0}}}  # the 8-device run out
  # A seed whose S-SGD never left its plateau would set the target at its
  # plateau: it is left out, every variant of it.
  records.write(
      "convergence",
      [final("ssgd", 0, 2), final("ssgd", 2, 2), final("power_sgd", 2, 2)],
      tmp_path,
  )
  records.write(
      "convergence_curves",
      [point("ssgd", 0, 10, 3.0), point("ssgd", 0, 20, 2.0),
       point("ssgd", 2, 10, 3.3), point("ssgd", 2, 20, 3.25),
       point("power_sgd", 2, 10, 3.3), point("power_sgd", 2, 20, 2.0)],
      tmp_path,
  )
  assert quality.simulated_curves(tmp_path, "char_lm", 2) == curves
  assert quality.target_loss("ssgd_final", curves) == 2.0
  assert quality.target_loss("ssgd_half", curves) == 3.0
  assert quality.target_loss("2.25", curves) == 2.25
  with pytest.raises(ValueError, match="ssgd_final"):
    quality.target_loss("ssgd_best", curves)
  with pytest.raises(ValueError, match="no S-SGD curves"):
    quality.target_loss("ssgd_half", quality.simulated_curves(
        tmp_path, "char_lm", 4))


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ("--repeats=2", "--seeds=0,1,2"),
            "--seeds names 3 seeds, more than --repeats=2",
        ),
        (
            ("--task=mnist", "--variants=ssgd,torch_power_sgd"),
            "--variants=torch_power_sgd trains the char LM only",
        ),
    ],
)
def test_a_run_that_cannot_be_made_is_refused_before_any_link(
    tmp_path, flags, error
):
  done = helpers.run_module(
      "benchmarks",
      f"--results_dir={tmp_path}",
      "quality",
      f"--char_lm_path={tmp_path}",
      f"--mnist_path={tmp_path}",
      *flags,
      timeout=300,
  )
  assert done.returncode != 0
  assert error in done.stderr


@pytest.mark.skipif(
    links.unavailable() is not None,
    reason=f"cannot build links here: {links.unavailable()}",
)
@pytest.mark.slow
def test_two_workers_train_to_a_target_across_a_shaped_link(tmp_path):
  """The trainer in each namespace stops at the target, each round at its
  own seed's step, and the link comes down; so do PyTorch DDP's workers,
  plain and with the PowerSGD hook, which sends less."""
  text = tmp_path / "text.txt"
  line = "the quick brown fox jumps over the lazy dog and sits on a mat\n"
  text.write_text(line * 3000)
  done = helpers.run_module(
      "benchmarks",
      f"--results_dir={tmp_path}",
      "quality",
      "--quick",
      "--task=char_lm",
      f"--char_lm_path={text}",
      "--variants=ssgd,acp_sgd_warm,torch_ssgd,torch_power_sgd",
      "--workers=2",
      "--bandwidths=100mbit",
      "--target=3.5",
      "--steps=24",
      "--eval_every=4",
      "--repeats=2",
      "--seeds=0,1",
      "--timeout=600",
      timeout=1500,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  runs = json.loads((tmp_path / "quality.json").read_text())
  assert [r["variant"] for r in runs] == [
      "ssgd", "acp_sgd_warm", "torch_ssgd", "torch_power_sgd"
  ]
  # The hook sends every gradient in its first two steps, then less.
  dense, hook = (r["bytes_sent"] / r["steps"] for r in runs[2:])
  assert 2 / runs[3]["steps"] * dense < hook < dense
  for r in runs:
    assert r["reached"] == "2/2" and r["steps"] < 24
    assert records.runs(r, "seed") == [0, 1]
    assert r["commit"] and r["train_seconds"] >= r["steady_seconds"] > 0
  # The trainer's first steps compile: its start-up is left out.
  assert all(r["train_seconds"] > r["steady_seconds"] for r in runs[:2])
  points = json.loads((tmp_path / "quality_curves.json").read_text())
  for r in runs:
    each = zip(records.runs(r, "seed"), records.runs(r, "steps"))
    for k, (seed, steps) in enumerate(each):
      mine = [
          p for p in points if p["variant"] == r["variant"]
          and p["round"] == k + 1
      ]
      assert {p["seed"] for p in mine} == {seed}
      assert max(p["step"] for p in mine) == steps
      assert min(p["eval_loss"] for p in mine) <= 3.5


def _quality_row(variant, bandwidth, seconds):
  return {
      "task": "char_lm",
      "workers": 2,
      "bandwidth": bandwidth,
      "variant": variant,
      "target_loss": 2.4,
      "reached": f"{sum(math.isfinite(s) for s in seconds)}/{len(seconds)}",
      "steps": 100,
      "bytes_sent": 1e6,
      **records.repeated("train_seconds", seconds),
      "date": "2026-12-06 03:00 UTC",
      "command": "quality",
      "machine": "test",
  }


def test_the_report_pairs_rounds_and_names_only_a_method_first_in_every_one():
  from benchmarks import report_quality

  run = [
      _quality_row("ssgd", "10mbit", [100.0, 120.0, 90.0]),
      _quality_row("power_sgd_warm", "10mbit", [20.0, 60.0, 30.0]),
      _quality_row("acp_sgd_2r_warm", "10mbit", [25.0, 40.0, math.inf]),
      _quality_row("ssgd", "1gbit", [10.0, 10.0, 10.0]),
      _quality_row("power_sgd_warm", "1gbit", [12.0, 11.0, 13.0]),
      _quality_row("acp_sgd_2r_warm", "1gbit", [11.0, 12.0, 9.0]),
  ]
  # Round by round, a capped round counting as never.
  assert report_quality.sooner(run[1], run[0]) == [5.0, 2.0, 3.0]
  assert report_quality.sooner(run[2], run[0]) == [4.0, 3.0, 0.0]
  # Beside the median of the rounds' ratios (3.0), the ratio of the
  # medians, 100 s over 30 s.
  shown = report_quality.rows(run)[1]
  assert shown["sooner"] == "3.00 (2.00–5.00)"
  assert shown["of_medians"] == "3.33"
  # Power-SGD was first in rounds 1 and 3 only; S-SGD at 1 Gb/s in rounds
  # 1 and 2 only.
  assert report_quality.fastest_every_round(run, 2, "10mbit") is None
  assert report_quality.fastest_every_round(run, 2, "1gbit") is None
  run[2] = _quality_row("acp_sgd_2r_warm", "10mbit", [15.0, 40.0, 20.0])
  assert report_quality.fastest_every_round(run, 2, "10mbit") == (
      "acp_sgd_2r_warm"
  )
  table = report_quality.summary_table(run).splitlines()
  assert table[0] == "| method | 10 Mb/s, 2 workers | 1 Gb/s, 2 workers |"
  # Seconds, the median of the rounds; S-SGD's over them, the median of
  # 100/15, 120/40 and 90/20; in bold, first in every round.
  assert table[4] == (
      "| ACP-SGD (r=8), 60 dense steps | **20 s, 4.50×** | 11 s, 0.91× |"
  )
  # A method that reached the target in no round has no ratio.
  run[4] = _quality_row("power_sgd_warm", "1gbit", [math.inf] * 3)
  assert "| not reached |" in report_quality.summary_table(run)
  assert "0.00×" not in report_quality.summary_table(run)
  assert report_quality.rows(run)[4]["of_medians"] == "not reached"


def test_the_overview_names_each_rounds_first_and_only_seeded_runs():
  from benchmarks import report_quality

  def seeded(variant, bandwidth, seconds, seeds):
    row = _quality_row(variant, bandwidth, seconds)
    return {**row, **{f"seed_run{i}": s for i, s in enumerate(seeds, 1)}}

  run = [
      seeded("ssgd", "10mbit", [100.0, 120.0, 90.0], [0, 1, 3]),
      seeded("power_sgd", "10mbit", [20.0, 60.0, 30.0], [0, 1, 3]),
      seeded("acp_sgd", "10mbit", [25.0, 40.0, math.inf], [0, 1, 3]),
      seeded("ssgd", "1gbit", [10.0, 10.0, 10.0], [0, 1, 3]),
      seeded("power_sgd", "1gbit", [12.0, 11.0, 13.0], [0, 1, 3]),
  ]
  # A run whose rounds all trained one seed says nothing of which method
  # comes first: left out.
  one_seed = [
      {**seeded("ssgd", "100mbit", [9.0, 9.0], [0, 0]), "date": "earlier"},
      {**seeded("acp_sgd", "100mbit", [1.0, 1.0], [0, 0]), "date": "earlier"},
  ]
  table = report_quality.overview_table(one_seed + run).splitlines()
  assert len(table) == 4
  assert table[2] == (
      "| char LM, AdamW | 2 | 10 Mb/s | test | none | 0: Power-SGD (r=4)"
      " 5.00×; 1: ACP-SGD (r=4) 3.00×; 3: Power-SGD (r=4) 3.00× |"
  )
  # S-SGD first in every round: no ratio to itself.
  assert table[3] == (
      "| char LM, AdamW | 2 | 1 Gb/s | test | S-SGD | 0: S-SGD; 1: S-SGD;"
      " 3: S-SGD |"
  )


def test_the_readme_table_takes_one_run():
  """Two runs (two machines, perhaps two targets) make two tables."""
  from benchmarks import report_quality

  first = _quality_row("ssgd", "10mbit", [100.0])
  other = {**_quality_row("ssgd", "100mbit", [10.0]), "date": "another"}
  with pytest.raises(ValueError, match="one run's records"):
    report_quality.summary_table([first, other])


def test_a_composed_only_variant_counts_by_its_composed_rounds():
  from benchmarks import report_quality

  simulated = {0: {4: 3.0, 8: 2.4}}
  rounds = [_round(None, 20.0, per_second=64.0), _round(None, 20.0, per_second=32.0)]
  r = quality.record(rounds, 2.5, simulated)
  # 8 steps to 2.5 at 0.5 s and at 1 s a step.
  assert records.runs(r, "composed_seconds") == [4.0, 8.0]
  ssgd = {**_quality_row("ssgd", "10mbit", [0.0, 0.0]), **r,
          "composed_only": True}
  acp = _quality_row("acp_sgd_2r_warm", "10mbit", [2.0, 2.0])
  assert report_quality.sooner(acp, ssgd) == [2.0, 4.0]
  assert "S-SGD | 6 s (composed) |" in report_quality.summary_table(
      [ssgd, acp]
  )
  # Its start-up, which the trained variants' seconds include, from each
  # round's first evaluation: 4 steps at 0.5 s (1 s) took 10 s (11 s).
  curves = [
      {"workers": 2, "bandwidth": "10mbit", "variant": "ssgd",
       "date": ssgd["date"], "round": i, "step": 4, "train_seconds": t}
      for i, t in ((1, 10.0), (2, 11.0))
  ]
  (with_startup, _) = report_quality.with_startup([ssgd, acp], curves)
  assert with_startup["startup_seconds"] == [8.0, 7.0]
  assert report_quality.sooner(acp, with_startup) == [6.0, 7.5]


def test_the_sooner_target_is_met_only_where_every_round_clears_it():
  from benchmarks import targets

  run = [
      _quality_row("ssgd", "10mbit", [100.0, 120.0, 90.0]),
      _quality_row("power_sgd_warm", "10mbit", [20.0, 60.0, 30.0]),
      _quality_row("acp_sgd_2r_warm", "10mbit", [15.0, 40.0, 20.0]),
      _quality_row("ssgd", "1gbit", [10.0, 10.0, 10.0]),  # no goal there
      _quality_row("acp_sgd_2r_warm", "1gbit", [1.0, 1.0, 1.0]),
  ]
  # PyTorch's hook, sooner still, is not acp_jax's compressed method.
  torch_row = _quality_row("torch_power_sgd", "10mbit", [5.0, 5.0, 5.0])
  (row,) = targets.check({"quality": run + [torch_row]})
  # ACP-SGD's rounds: 100/15, 120/40, 90/20; the lowest is 3.
  # The median of the rounds' ratios, their range, and the ratio of the
  # medians beside them.
  assert row[1] == (
      "ACP-SGD (r=8), 60 dense steps: 4.50x (3.00-6.67); of medians 5.00x"
  )
  assert row[2] is True
  run[2] = _quality_row("acp_sgd_2r_warm", "10mbit", [15.0, 41.0, 20.0])
  assert targets.check({"quality": run})[0][2] is False


def test_the_sooner_target_pairs_each_method_with_its_own_runs_s_sgd():
  """Two runs of one point: each method's rounds against the S-SGD of its
  own run, each run a row of its own, named by its date."""
  from benchmarks import targets

  first = [
      _quality_row("ssgd", "10mbit", [100.0]),
      _quality_row("power_sgd_warm", "10mbit", [50.0]),
  ]
  later = [
      {**r, "date": "2026-12-06 23:00 UTC"}
      for r in (
          _quality_row("ssgd", "10mbit", [200.0]),
          _quality_row("power_sgd", "10mbit", [25.0]),
      )
  ]
  rows = targets.check({"quality": first + later})
  assert [(r[0].split(":")[0], r[1], r[2]) for r in rows] == [
      (
          "char_lm, 2 workers, 10 Mb/s (the run of 2026-12-06 03",
          "Power-SGD (r=4), 60 dense steps: 2.00x; of medians 2.00x",
          False,
      ),
      (
          "char_lm, 2 workers, 10 Mb/s (the run of 2026-12-06 23",
          "Power-SGD (r=4): 8.00x; of medians 8.00x",
          True,
      ),
  ]


def test_the_report_shows_a_warmed_composition_only_where_its_warm_up_was_priced():
  from benchmarks import report_quality

  composed = {"composed_seconds": 50.0, "composed_agrees": True}
  old = {**_quality_row("power_sgd_warm", "10mbit", [55.0]), **composed}
  new = {**old, "composed_warmup": 60}
  plain = {**_quality_row("power_sgd", "10mbit", [55.0]), **composed}
  shown = [r.get("composed") for r in report_quality.rows([old, new, plain])]
  assert shown == [None, 50.0, 50.0]


def _advice_row(method, rank, step_s, error_to_noise):
  from acp_jax_tools import advice as advice_lib

  row = advice_lib.Row(
      advice_lib.Candidate(method, rank), step_s, 1.0, 1.0, 0.0,
      error_to_noise, 1.0
  )
  return {
      **row.as_dict(),
      "model": "char_lm",
      "workers": 2,
      "bandwidth": 1e6,
      "threshold": 0.5,
      "max_gap": 0.1,
      "calibration": "test",
      "machine": "test",
      "date": "2026-01-01 00:00 UTC",
      "command": "advise",
  }


def test_the_advice_is_judged_on_each_points_time_to_quality():
  """At each point, the advice's pick among the methods measured there (the
  fastest predicted within its threshold, for the point's link) against
  the fastest to the target, round by round; a method it ranks but that
  the point did not run is passed over."""
  from benchmarks import advice_check
  from benchmarks import targets

  run = [
      _quality_row("ssgd", "10mbit", [100.0, 100.0, 100.0]),
      _quality_row("power_sgd", "10mbit", [22.0, 30.0, 28.0]),
      _quality_row("acp_sgd", "10mbit", [20.0, 25.0, 25.0]),
      _quality_row("acp_sgd_2r", "10mbit", [24.0, 26.0, 40.0]),
  ]
  links = [{"bandwidth": "10mbit", "workers": 2, "beta_s_per_byte": 1e-6}]
  # Ranked fastest first: Sign-SGD (not run here), ACP-SGD r4 (beyond the
  # threshold), then ACP-SGD r8.
  advice = [
      _advice_row("sign_sgd", None, 0.1, 0.1),
      _advice_row("acp_sgd", 4, 0.2, 0.9),
      _advice_row("acp_sgd", 8, 0.3, 0.4),
      _advice_row("power_sgd", 4, 0.4, 0.2),
      _advice_row("ssgd", None, 2.0, 0.0),
  ]
  # PyTorch's methods, the fastest here, are not the advice's to pick:
  # judged among acp_jax's.
  torch_row = _quality_row("torch_power_sgd", "10mbit", [5.0, 5.0, 5.0])
  (point,) = advice_check.quality_points(
      run + [torch_row], [], links, advice
  )
  assert point["fastest"] == "acp_sgd_r4" and point["advised"] == "acp_sgd_r8"
  # Medians 26 against 25; rounds 24/20, 26/25 and 40/25.
  assert point["ratio"] == pytest.approx(26 / 25)
  assert point["ratio_max"] == pytest.approx(1.6)
  rows = targets.check({"quality": run, "cluster_links": links,
                        "advice": advice})
  (row,) = [r for r in rows if "advised method reaches" in r[0]]
  assert row[1] == "1 of 1 points advised; worst round 1.60x"
  assert row[2] is False
  assert point["short_runs"] == "none"
  # A later record of the point replaces it: its short runs measured
  # ACP-SGD r8 at twice S-SGD's steps, so Power-SGD r4 is sooner to the loss.
  steps = lambda r: 2.0 if r["name"] == "acp_sgd_r8" else 1.0
  later = sorted(
      (
          {
              **r,
              "date": "2026-01-02 00:00 UTC",
              "run_steps": 100,
              "run_repeats": 3,
              **dict.fromkeys(("steps", "steps_low", "steps_high"), steps(r)),
          }
          for r in advice
      ),
      key=lambda r: r["step_s"] * r["steps"],
  )
  (point,) = advice_check.quality_points(run, [], links, advice + later)
  assert point["advised"] == "power_sgd_r4"
  assert point["short_runs"] == "3 x 100 steps"
  # Power-SGD predicted within the advice's tie (2 %) of ACP-SGD r8: the
  # lower error is picked, as the advice picks it.
  advice[3] = _advice_row("power_sgd", 4, 0.305, 0.2)
  (point,) = advice_check.quality_points(run, [], links, advice)
  assert point["advised"] == "power_sgd_r4"
  assert point["ratio_max"] == pytest.approx(30 / 25)
  # No advice record for the point's link, or made on another machine: no
  # point.
  other = [{**r, "bandwidth": 2e6} for r in advice]
  assert advice_check.quality_points(run, [], links, other) == []
  other = [{**r, "machine": "another"} for r in advice]
  assert advice_check.quality_points(run, [], links, other) == []


def test_the_errors_listing_names_each_measured_error_once():
  """Advice records at several links measure the same errors again."""
  from benchmarks import report_cluster

  record = lambda name, error, link: {
      "model": "mnist", "workers": 2, "name": name, "bandwidth": link,
      "error_to_noise": error, "cosine": 0.9,
  }
  advice = [
      record("ssgd", 0.0, 1e6),
      record("power_sgd_r4", 0.165, 1e6),
      record("power_sgd_r4", 0.165, 1e7),
      record("power_sgd_r4", 0.2, 1e8),  # measured otherwise: shown too
  ]
  assert report_cluster.measured_errors(advice) == (
      "mnist on 2 workers: power_sgd_r4 0.165 (cosine 0.900),"
      " power_sgd_r4 0.200 (cosine 0.900)"
  )
