"""The convergence benchmark's plan, configs and summaries (no training)."""

import ml_collections
import pytest

from benchmarks import convergence
from benchmarks import convergence_summary
from benchmarks import direction as bench_direction
from benchmarks import plots
from benchmarks import records
from benchmarks import report
from benchmarks import targets
from tests.conftest import NUM_DEVICES
from train import config as config_lib
from train import experiment


@pytest.fixture
def text(tmp_path):
  path = tmp_path / "text.txt"
  path.write_text("to be or not to be\n" * 50)
  return str(path)


def test_every_planned_run_has_a_valid_config_naming_its_optimizer(text):
  for seed, task, variant in convergence.plan(list(convergence.TASKS), False):
    if convergence.config_name(task) == "mnist":
      continue  # its loader checks the files when it runs
    cfg = convergence.config(task, variant, text, quick=False, seed=seed)
    config_lib.validate(cfg, NUM_DEVICES)
    expected = "sgd" if task == "char_lm_sgd" else "adamw"
    assert cfg.optimizer.name == expected, (task, variant)
  long = convergence.config("char_lm_long", "ssgd", text, quick=False)
  assert long.num_train_steps >= 1000
  # The long task is the 300-step one but for its budget.
  short = convergence.config("char_lm", "ssgd", text, quick=False)
  for key in ("batch_size", "optimizer", "model", "schedule", "data"):
    assert long[key] == short[key], key


def test_the_long_mnist_task_is_the_300_step_one_but_for_its_budget(
    tmp_path,
):
  def mnist(task):
    return convergence.config(task, "ssgd", str(tmp_path), quick=False)

  long, short = mnist("mnist_long"), mnist("mnist")
  assert long.num_train_steps > short.num_train_steps
  for key in ("batch_size", "optimizer", "model", "schedule", "data"):
    assert long[key] == short[key], key


def test_eval_every_replaces_the_tasks_cadence_and_nothing_else(text):
  own = convergence.config("char_lm_sgd", "power_sgd", text, quick=False)
  every_25 = convergence.config(
      "char_lm_sgd", "power_sgd", text, quick=False, eval_every=25
  )
  assert own.eval_every_steps == 50 and every_25.eval_every_steps == 25
  every_25.eval_every_steps = own.eval_every_steps
  assert every_25 == own


def test_the_bfloat16_variants_send_power_sgd_rank_r_bytes(text):
  def mean_bytes(variant):
    e = experiment.build(convergence.config("char_lm", variant, text, False))
    steps = e.bytes_per_step()
    return sum(steps) / len(steps)

  budget = mean_bytes("power_sgd_warm")
  for variant in ("power_sgd_2r_bf16_warm", "acp_sgd_4r_bf16_warm"):
    assert mean_bytes(variant) == budget, variant
  assert mean_bytes("acp_sgd_2r_bf16_warm") < budget


def test_bert_mlm_compares_power_sgd_and_acp_sgd_at_equal_bytes(text):
  def mean_bytes(variant):
    cfg = convergence.config("bert_mlm", variant, text, False)
    # The bytes follow the shapes alone: synthetic tokens of the same
    # vocabulary and length need no tokenizer trained on a real text.
    cfg.data = ml_collections.ConfigDict(
        {
            "name": "synthetic_tokens",
            "seq_len": cfg.data.seq_len,
            "vocab_size": cfg.data.vocab_size,
            "task": "masked_lm",
            "num_examples": 8,
        }
    )
    steps = experiment.build(cfg).bytes_per_step()
    return sum(steps) / len(steps)

  power = mean_bytes("power_sgd_warm")
  # ACP-SGD at 2r compresses every matrix that Power-SGD at r does.
  assert mean_bytes("acp_sgd_2r_warm") == power
  assert power < mean_bytes("ssgd") / 10


def _curve(variant, points, seed=0, task="t"):
  return [
      {
          "task": task,
          "variant": variant,
          "seed": seed,
          "step": s,
          "eval_loss": l,
      }
      for s, l in points
  ]


def test_steps_to_target_interpolates_between_evaluations():
  curves = _curve("ssgd", [(50, 2.0), (100, 1.5)]) + _curve(
      "slow", [(50, 2.2), (100, 1.7), (150, 1.4)]
  )
  # S-SGD reaches its final 1.5 at step 100; "slow" between 100 and 150,
  # at 1.7 - 2/3 of the way down to 1.4: step 100 + 50 * 2/3.
  ratio = convergence_summary.steps_to_target(curves, "t", "slow")
  assert ratio == pytest.approx((100 + 50 * 2 / 3) / 100)
  assert convergence_summary.steps_to_target(curves, "t", "ssgd") == 1.0


def test_steps_to_target_is_none_where_the_target_is_not_reached():
  curves = _curve("ssgd", [(50, 2.0), (100, 1.5)]) + _curve(
      "stuck", [(50, 2.0), (100, 1.6)]
  )
  assert convergence_summary.steps_to_target(curves, "t", "stuck") is None
  assert convergence_summary.steps_to_target(curves, "other", "stuck") is None


def test_steps_cost_is_the_steps_over_ssgds_steps_to_the_same_loss():
  curves = (
      _curve("ssgd", [(50, 2.0), (100, 1.5), (200, 1.0)])
      + _curve("behind", [(100, 1.8), (200, 1.5)])
      + _curve("ahead", [(100, 1.5), (200, 0.9)])
  )
  # S-SGD is at 1.5 at step 100: "behind" took 200 steps to it.
  assert convergence_summary.steps_cost(curves, "t", "behind") == 2.0
  assert convergence_summary.steps_cost(curves, "t", "ahead") is None
  assert convergence_summary.steps_cost(curves, "t", "ssgd") is None


def test_steps_to_target_takes_the_mean_over_seeds():
  curves = (
      _curve("ssgd", [(100, 1.0)])
      + _curve("v", [(100, 1.2), (200, 0.9)], seed=0)
      + _curve("v", [(100, 1.0), (200, 0.9)], seed=1)
  )
  # Mean 1.1 at 100, 0.9 at 200: 1.0 is reached halfway.
  assert convergence_summary.steps_to_target(curves, "t", "v") == pytest.approx(
      1.5
  )


def test_summary_names_the_optimizer_and_the_ratio():
  finals = [
      {
          "task": "t",
          "variant": v,
          "optimizer": "adamw",
          "compressor": v,
          "rank": None,
          "warmup_steps": 0,
          "steps": 200,
          "bytes_per_step": 1,
          "seed": 0,
          "eval_loss": loss,
          "eval_accuracy": 0.5,
          "bytes_sent": 200,
          "wall_seconds": 1.0,
      }
      for v, loss in (("ssgd", 1.0), ("v", 0.9))
  ]
  curves = _curve("ssgd", [(100, 1.2), (200, 1.0)]) + _curve(
      "v", [(100, 1.0), (200, 0.9)]
  )
  rows = {
      r["variant"]: r for r in convergence_summary.summarize(finals, curves)
  }
  assert rows["v"]["optimizer"] == "adamw"
  assert rows["v"]["steps_to_target_ratio"] == pytest.approx(0.5)
  assert rows["v"]["loss_vs_ssgd_pct"] == pytest.approx(-10.0)
  assert "steps_to_target_ratio" not in convergence_summary.summarize(finals)[0]


def test_a_seed_whose_ssgd_run_stays_on_its_plateau_is_left_out():
  def final(variant, seed, loss):
    return {
        "task": "t",
        "variant": variant,
        "seed": seed,
        "eval_loss": loss,
        "eval_accuracy": 0.5,
        "bytes_sent": 1,
        "wall_seconds": 1.0,
    }

  # Seed 1's S-SGD ends 1.5 % below its first evaluation: a plateau; the
  # compressed run of that seed, which left it, would count as -30 %.
  finals = [
      final("ssgd", 0, 2.0),
      final("v", 0, 2.1),
      final("ssgd", 1, 3.35),
      final("v", 1, 2.35),
  ]
  curves = (
      _curve("ssgd", [(50, 3.3), (300, 2.0)], seed=0)
      + _curve("v", [(50, 3.3), (300, 2.1)], seed=0)
      + _curve("ssgd", [(50, 3.4), (300, 3.35)], seed=1)
      + _curve("v", [(50, 3.4), (300, 2.35)], seed=1)
  )
  assert convergence_summary.untrained_seeds(curves) == {("t", 1)}
  rows = {
      r["variant"]: r for r in convergence_summary.summarize(finals, curves)
  }
  assert rows["v"]["seeds"] == 1 and rows["v"]["seeds_left_out"] == 1
  assert rows["v"]["loss_vs_ssgd_pct"] == pytest.approx(5.0)
  # Without curves nothing tells a plateau: every seed counts.
  (row,) = [
      r for r in convergence_summary.summarize(finals) if r["variant"] == "v"
  ]
  assert row["seeds"] == 2 and row["seeds_left_out"] == 0
  kept_finals, kept_curves, left_out = convergence_summary.without_untrained(
      finals, curves
  )
  assert left_out == {("t", 1)}
  assert {r["seed"] for r in kept_finals + kept_curves} == {0}


def test_the_report_plots_the_seeds_its_table_summarizes(monkeypatch, tmp_path):
  finals, curves, direction = (
      records.read(name, records.RESULTS_DIR)
      for name in (
          "convergence",
          "convergence_curves",
          "convergence_direction",
      )
  )
  drawn = []
  monkeypatch.setattr(plots, "convergence", lambda c, path: drawn.extend(c))
  (text,) = report._convergence_section(finals, curves, direction, tmp_path)
  left_out = convergence_summary.untrained_seeds(curves)
  assert drawn == [
      c
      for c in curves
      if (c["task"], c["seed"]) not in left_out
      and c["variant"] in convergence.VARIANTS
  ]
  below_plot = text.split("![convergence](convergence.png)")[1]
  assert below_plot.lstrip().startswith("Left out of the plot")
  for task, seed in left_out:
    assert f"`{task}` seed {seed}" in below_plot.split("\n\n")[1]
  # The runs of variants the benchmark no longer has are all shown, apart.
  current, closed = text.split("### Closed experiments")
  gone = {r["variant"] for r in finals} - set(convergence.VARIANTS)
  gone |= {
      r["variant"]
      for r in direction
      if not bench_direction.is_measured(r["variant"])
  }
  assert gone
  for variant in gone:
    assert f"| {variant} " in closed and f"| {variant} " not in current, variant


def test_plan_runs_the_variants_asked_for_in_their_order():
  runs = convergence.plan(
      ["char_lm_long", "mnist"], False, ["power_sgd_2r_bf16_warm", "ssgd"]
  )
  assert runs[:3] == [
      (0, "char_lm_long", "power_sgd_2r_bf16_warm"),
      (0, "char_lm_long", "ssgd"),
      (0, "mnist", "ssgd"),
  ]
  assert len(runs) == 3 * convergence.SEEDS
  with pytest.raises(ValueError, match="unknown variant.*acp_sgd_3r"):
    convergence.plan(["char_lm"], False, ["acp_sgd_3r"])


def test_the_adamw_targets_take_bfloat16_factors_at_power_sgd_rank_r_bytes():
  def final(variant, compressor, rank, dtype, nbytes, loss):
    return {
        "task": "char_lm_long",
        "variant": variant,
        "optimizer": "adamw",
        "compressor": compressor,
        "rank": rank,
        "comm_dtype": dtype,
        "warmup_steps": 0 if compressor == "ssgd" else 60,
        "bytes_per_step": nbytes,
        "seed": 0,
        "eval_loss": loss,
        "eval_accuracy": 0.5,
        "bytes_sent": 1,
        "wall_seconds": 1.0,
    }

  finals = [
      final("ssgd", "ssgd", None, None, 1000, 1.0),
      final("power_sgd_warm", "power_sgd", 4, None, 100, 1.07),
      final("power_sgd_2r_bf16_warm", "power_sgd", 8, "bfloat16", 100, 1.02),
      final("acp_sgd_2r_warm", "acp_sgd", 8, None, 100, 1.08),
      final("acp_sgd_4r_bf16_warm", "acp_sgd", 16, "bfloat16", 100, 1.025),
      # More bytes than Power-SGD rank 4's: no candidate for either line.
      final("acp_sgd_big", "acp_sgd", 32, None, 400, 1.0),
      final("power_sgd_big", "power_sgd", 16, None, 400, 1.0),
  ]
  lines = {
      what.split(": ", 1)[1].split(",")[0]: (measured, met)
      for what, measured, met in targets._accuracy({"convergence": finals})
  }
  acp, acp_met = lines["ACP-SGD with warm-up"]
  assert acp.startswith("acp_sgd_4r_bf16_warm: +2.50 %") and acp_met
  power, power_met = lines["Power-SGD with warm-up"]
  assert power.startswith("power_sgd_2r_bf16_warm: +2.00 %") and power_met
  # Without the bfloat16 variants both targets read the float32 ones.
  plain = [f for f in finals if not f["comm_dtype"]]
  assert [
      (measured.split(":")[0], met)
      for _, measured, met in targets._accuracy({"convergence": plain})
  ] == [("acp_sgd_2r_warm", False), ("power_sgd_warm", False)]
