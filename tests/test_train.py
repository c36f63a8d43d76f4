"""The train loop: learning, no hidden communication, exact resume, errors."""

import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acp_jax_tools import hlo
from configs import default
from tests import helpers
from tests.conftest import NUM_DEVICES
from train import experiment as experiment_lib
from train import loss as loss_lib
from train import metrics as metrics_lib
from train import plots
from train import train

COMPRESSORS = ("ssgd", "sign_sgd", "topk_sgd", "power_sgd", "acp_sgd")


def small_config(compressor="acp_sgd", steps=6, **overrides):
  config = default.get_config()
  config.compressor.name = compressor
  config.compressor.topk_sgd.density = 0.1
  config.model.width = 8
  config.num_train_steps = steps
  config.batch_size = 64
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  # A schedule that does not depend on num_train_steps, so that runs of
  # different lengths can be compared step by step.
  config.schedule = {"name": "constant", "warmup_steps": 0}
  # Compressing from the first step: the warm-up has tests of its own.
  config.compressor.power_sgd.warmup_steps = 0
  config.compressor.acp_sgd.warmup_steps = 0
  config.update(overrides)
  return config


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  train_lines = [l for l in lines if "loss" in l]
  eval_lines = [l for l in lines if "eval_loss" in l]
  return train_lines, eval_lines


def read_tensorboard(workdir):
  """{tag: [(step, value), ...]} as TensorBoard itself reads the events."""
  accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator"
  )
  events = accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  events.Reload()
  return {
      tag: [(e.step, e.value) for e in events.Scalars(tag)]
      for tag in events.Tags()["scalars"]
  }


def losses(workdir):
  return {l["step"]: l["loss"] for l in read_metrics(workdir)[0]}


@pytest.fixture(scope="module")
def acp_run(tmp_path_factory):
  """Six steps of ACP-SGD on digits, shared by the tests that read a run."""
  workdir = str(tmp_path_factory.mktemp("acp"))
  summary = train.train_and_evaluate(small_config(), workdir)
  return workdir, summary


def test_metrics_lines(acp_run):
  workdir, summary = acp_run
  train_lines, eval_lines = read_metrics(workdir)
  assert [l["step"] for l in train_lines] == list(range(1, 7))
  experiment = experiment_lib.build(small_config())
  phases = experiment.bytes_per_step()
  assert len(phases) == 2  # ACP-SGD alternates P and Q steps
  for line in train_lines:
    assert {"loss", "learning_rate", "bytes_sent", "examples_per_sec"} <= set(
        line
    )
    assert np.isfinite(line["loss"]) and line["examples_per_sec"] > 0
    assert line["bytes_sent"] == phases[(line["step"] - 1) % 2]
  assert train_lines[0]["learning_rate"] == pytest.approx(0.1)
  assert [l["step"] for l in eval_lines] == [6]
  assert 0 <= eval_lines[0]["eval_accuracy"] <= 1
  assert summary["eval_accuracy"] == eval_lines[0]["eval_accuracy"]
  assert summary["bytes_per_step"] == sum(phases) / 2


def test_tensorboard_holds_every_logged_number(acp_run):
  workdir, _ = acp_run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  expected = {}
  for record in records:
    for key, value in record.items():
      if key not in ("step", "run"):  # the run's id is no number
        # Event files hold 32-bit floats.
        point = (record["step"], np.float32(value))
        expected.setdefault(key, []).append(point)
  scalars = read_tensorboard(workdir)
  assert {"loss", "eval_loss", "bytes_sent", "bytes_sent_total"} <= set(scalars)
  assert scalars == expected
  # The held-out point carries the bytes sent up to it.
  experiment = experiment_lib.build(small_config())
  assert scalars["bytes_sent_total"][-1] == (6, experiment.bytes_through(6))


def test_comparison_figure_draws_each_run_against_steps_and_bytes(acp_run):
  pytest.importorskip("matplotlib")
  workdir, _ = acp_run
  records = metrics_lib.read_curves(workdir)
  figure = plots.comparison_figure({"acp_sgd": workdir, "again": workdir})
  panels = [
      (y, x) for y in ("loss", "accuracy") for x in ("step", "bytes_sent_total")
  ]
  assert len(figure.axes) == len(panels)
  for ax, (y, x) in zip(figure.axes, panels):
    train_points = [(r[x], r[y]) for r in records if y in r]
    eval_points = [(r[x], r[f"eval_{y}"]) for r in records if f"eval_{y}" in r]
    assert len(train_points) == 6 and len(eval_points) == 1
    # Two runs, each a train line and its held-out points.
    lines = ax.get_lines()
    assert [l.get_label() for l in lines] == [
        "acp_sgd",
        "acp_sgd (held out)",
        "again",
        "again (held out)",
    ]
    for line, points in zip(lines, [train_points, eval_points] * 2):
      np.testing.assert_array_equal(line.get_xydata(), points)


@pytest.mark.slow
def test_compare_command_writes_the_plot_and_tensorboard(tmp_path):
  pytest.importorskip("matplotlib")
  result = helpers.run_module(
      "train",
      "--config=configs/default.py",
      f"--workdir={tmp_path}",
      "--num_cpu_devices=8",
      "--compare=ssgd,acp_sgd",
      "--config.num_train_steps=4",
      "--config.model.width=8",
      "--config.checkpoint_every_steps=0",
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"curves: {tmp_path / plots.FILENAME}" in result.stdout
  with open(tmp_path / plots.FILENAME, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  for name in ("ssgd", "acp_sgd"):
    assert read_tensorboard(str(tmp_path / name))["loss"][-1][0] == 4


@pytest.mark.slow
def test_resume_is_bitwise_identical(acp_run, tmp_path):
  """Three steps, then the same command with six: steps 4-6 match exactly.

  Three is odd, so the restored ACP-SGD state is in its Q phase.
  """
  reference, _ = acp_run
  workdir = str(tmp_path)
  train.train_and_evaluate(small_config(steps=3), workdir)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["3"]
  summary = train.train_and_evaluate(small_config(steps=6), workdir)
  assert losses(workdir) == losses(reference)  # floats compared exactly
  assert summary["params_sha256"] == acp_run[1]["params_sha256"]


@pytest.mark.slow
def test_crash_after_a_checkpoint_resumes_and_logs_each_step_once(tmp_path):
  """A run that died after logging step 4 but before saving it."""
  workdir = str(tmp_path)
  config = small_config(steps=4, checkpoint_every_steps=1, keep_checkpoints=2)
  train.train_and_evaluate(config, workdir)
  before = losses(workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(ckpt_dir)) == ["3", "4"]  # the last two kept
  shutil.rmtree(os.path.join(ckpt_dir, "4"))
  train.train_and_evaluate(config, workdir)
  train_lines, _ = read_metrics(workdir)
  assert [l["step"] for l in train_lines] == [1, 2, 3, 4]
  assert losses(workdir) == before
  # TensorBoard hides the first run's step 4 too.
  steps = [step for step, _ in read_tensorboard(workdir)["loss"]]
  assert steps == [1, 2, 3, 4]


def test_a_run_stops_at_the_first_evaluation_that_reaches_its_target(tmp_path):
  """Time to quality: uncapped, the run's held-out losses at steps 2, 4, 6
  and 8; with a target between them it stops at the first that reaches
  it, saves there and records the step; unreachable, it runs to its cap."""
  config = small_config("ssgd", steps=8, eval_every_steps=2)
  capped = train.train_and_evaluate(config, str(tmp_path / "capped"))
  _, evals = read_metrics(tmp_path / "capped")
  curve = {l["step"]: l["eval_loss"] for l in evals}
  assert list(curve) == [2, 4, 6, 8] and "target_step" not in capped
  seconds = [l["train_seconds"] for l in evals]
  assert 0 < seconds[0] < seconds[1] < seconds[2] < seconds[3]
  target = curve[4]
  expected = min(s for s, loss in curve.items() if loss <= target)

  config.target_eval_loss = target
  workdir = tmp_path / "target"
  summary = train.train_and_evaluate(config, str(workdir))
  assert summary["target_step"] == summary["step"] == expected
  assert summary["eval_loss"] == curve[expected] <= target
  assert summary["bytes_sent"] == capped["bytes_sent"] * expected // 8
  assert os.listdir(workdir / "checkpoints") == [str(expected)]
  train_lines, evals = read_metrics(workdir)
  assert [l["step"] for l in evals][-1] == expected
  assert train_lines[-1]["step"] == expected

  config.target_eval_loss = min(curve.values()) / 10
  summary = train.train_and_evaluate(config, str(tmp_path / "unreached"))
  assert summary["target_step"] is None and summary["step"] == 8


@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.slow
def test_each_compressor_learns_digits(compressor, tmp_path):
  config = small_config(compressor, steps=60)
  config.model.width = 16
  # Decaying the rate lets BatchNorm's running statistics, which eval uses,
  # catch up with the weights.
  config.schedule = {
      "name": "cosine",
      "warmup_steps": 5,
      "cosine": {"end_factor": 0.0},
  }
  summary = train.train_and_evaluate(config, str(tmp_path))
  # Chance is 0.1.
  assert summary["eval_accuracy"] > 0.7, summary


def _compiled_bytes(experiment):
  """Collective bytes of the compiled train step, per phase."""
  train_fn, _ = train.compile_steps(experiment)
  batch = experiment_lib.abstract_batch(experiment)
  totals = []
  for state in experiment_lib.abstract_phase_states(experiment).values():
    text = train_fn.lower(state, batch).compile().as_text()
    stats = hlo.collective_stats(text)
    totals.append(sum(s.bytes for s in stats.values()))
  return totals


@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.slow
def test_train_step_sends_only_what_is_accounted(compressor):
  """Compressor bytes + 20 metric bytes: no hidden dense all-reduce."""
  experiment = experiment_lib.build(small_config(compressor))
  assert _compiled_bytes(experiment) == experiment.bytes_per_step()


def test_sync_batch_norm_bytes_are_counted():
  experiment = experiment_lib.build(small_config("power_sgd", batch_norm="sync"))
  local = experiment_lib.build(small_config("power_sgd"))
  # small_cnn has BN layers of 8, 8 and 16 channels: 4 floats each.
  assert (
      experiment.bytes_per_step()[0] - local.bytes_per_step()[0] == 4 * 4 * 32
  )
  assert _compiled_bytes(experiment) == experiment.bytes_per_step()


def test_acp_step_compiles_once_per_phase(tmp_path):
  experiment = experiment_lib.build(small_config())
  train_fn, _ = train.compile_steps(experiment)
  state = experiment_lib.init_state(experiment)
  batch = experiment_lib.put_batch(
      experiment, experiment.dataset.train.get(np.arange(64))
  )
  for _ in range(4):
    state, _ = train_fn(state, batch)
    jax.block_until_ready(state)
  assert train_fn._cache_size() == 2  # pylint: disable=protected-access


def test_params_digest_catches_drifted_replicas():
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  sharding = NamedSharding(mesh, P())
  same = jax.device_put(np.ones(3, np.float32), sharding)
  assert len(metrics_lib.params_digest({"w": same})) == 64
  drifted = jax.make_array_from_single_device_arrays(
      (3,),
      sharding,
      [
          jax.device_put(np.full(3, float(i == 5), np.float32), d)
          for i, d in enumerate(mesh.devices.flat)
      ],
  )
  with pytest.raises(RuntimeError, match=r"params\['w'\]"):
    metrics_lib.params_digest({"w": drifted})


@pytest.mark.parametrize(
    "override, match",
    [
        ({"compressor.name": "qsgd"}, "config.compressor.name"),
        ({"compressor.rnak": 4}, "config.compressor.rnak"),
        (
            {"compressor.acp_sgd.rnak": 4},
            "config.compressor.acp_sgd: .*unexpected keyword argument 'rnak'",
        ),
        ({"compressor.acp_sgd.rank": 0}, "config.compressor.acp_sgd: rank"),
        ({"num_train_stepz": 4}, "config.num_train_stepz"),
        ({"batch_size": 100}, "config.batch_size=100 is not divisible"),
        ({"data.name": "mnist", "data.path": "/nonexistent"}, "/nonexistent"),
        ({"optimizer.momentun": 0.9}, "config.optimizer.momentun"),
        ({"target_eval_loss": -1.0}, "config.target_eval_loss"),
        ({"target_eval_loss": float("nan")}, "config.target_eval_loss"),
    ],
)
def test_bad_config_fails_before_compiling(
    override, match, monkeypatch, tmp_path
):
  config = small_config()
  for key, value in override.items():
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value

  def compiled(*args, **kwargs):
    raise AssertionError("compiled before checking the config")

  monkeypatch.setattr(train, "compile_steps", compiled)
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    train.train_and_evaluate(config, str(tmp_path))


def test_a_batch_larger_than_memory_is_refused_naming_the_key(
    monkeypatch, tmp_path
):
  config = small_config()
  config.batch_size = 4_000_000_000

  def compiled(*args, **kwargs):
    raise AssertionError("compiled before checking the batch size")

  monkeypatch.setattr(train, "compile_steps", compiled)
  with pytest.raises(ValueError) as error:
    train.train_and_evaluate(config, str(tmp_path))
  first = str(error.value).splitlines()[0]
  assert first.startswith("config.batch_size=4000000000 needs")
  assert "lower config.batch_size" in first
  assert "the training set holds" in first
  assert not os.listdir(tmp_path)  # refused before the workdir is touched


def test_sync_batch_norm_step_is_the_full_batch_step():
  """With S-SGD and synced BN, 8 devices take the one-device full-batch step.

  The backward pass must all-reduce the statistics' cotangents for this to
  hold; local BN (each device its own statistics) does not.
  """
  sgd = {"name": "sgd", "learning_rate": 1.0, "sgd": {"momentum": 0.0}}
  batch = experiment_lib.build(small_config()).dataset.train.get(np.arange(64))

  def one_step(batch_norm):
    experiment = experiment_lib.build(
        small_config("ssgd", batch_norm=batch_norm, optimizer=sgd)
    )
    train_fn, _ = train.compile_steps(experiment)
    state = experiment_lib.init_state(experiment)
    before = jax.device_get((state.params, state.batch_stats))
    new_state, _ = train_fn(state, experiment_lib.put_batch(experiment, batch))
    return before, jax.device_get(new_state.params)

  (params, batch_stats), synced = one_step("sync")
  # The graph without an axis name: BN over the whole batch on one device.
  graphdef = experiment_lib.build(small_config("ssgd", optimizer=sgd)).graphdef

  def full_batch_loss(params, batch_stats):
    model = nnx.merge(graphdef, params, batch_stats)
    logits = model(batch["inputs"], train=True)
    loss_sum, _, weight = loss_lib.weighted_sums(logits, batch)
    return loss_sum / weight

  grads = jax.jit(jax.grad(full_batch_loss))(params, batch_stats)
  expected = jax.tree.map(lambda p, g: p - g, params, grads)
  chex.assert_trees_all_close(synced, expected, atol=2e-5)
  _, local = one_step("local")
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(local, expected, atol=2e-5)


def test_throughput_is_measured_on_eval_and_checkpoint_steps(tmp_path):
  config = small_config(steps=8, eval_every_steps=3, checkpoint_every_steps=4)
  train.train_and_evaluate(config, str(tmp_path))
  speeds = {l["step"]: l["examples_per_sec"] for l in read_metrics(str(tmp_path))[0]}
  steady = [v for k, v in speeds.items() if k > 2]  # two phases compile
  # Eval (3, 6) and checkpoint (4, 8) steps once logged 100x the others.
  assert max(steady) < 5 * np.median(steady), speeds


def warmup_config(steps):
  config = small_config(steps=steps)
  config.compressor.acp_sgd.warmup_steps = 3
  return config


@pytest.mark.slow
def test_warmup_logs_dense_bytes_compiles_each_phase_and_resumes_exactly(
    tmp_path,
):
  """Three dense steps, then P, Q, P: each step logs its own phase's bytes,
  each phase's compiled step sends them, and a run stopped inside the
  warm-up or just after it resumes bit for bit."""
  experiment = experiment_lib.build(warmup_config(6))
  by_phase = experiment.bytes_per_phase()
  assert list(by_phase) == ["dense", "p", "q"]
  assert _compiled_bytes(experiment) == list(by_phase.values())
  reference = str(tmp_path / "reference")
  summary = train.train_and_evaluate(warmup_config(6), reference)
  train_lines, _ = read_metrics(reference)
  expected = ["dense"] * 3 + ["p", "q", "p"]
  assert [l["bytes_sent"] for l in train_lines] == [by_phase[p] for p in expected]
  assert summary["bytes_sent"] == sum(by_phase[p] for p in expected)
  assert train_lines[-1]["bytes_sent_total"] == summary["bytes_sent"]
  for stop in (2, 4):
    workdir = str(tmp_path / f"stop{stop}")
    train.train_and_evaluate(warmup_config(stop), workdir)
    resumed = train.train_and_evaluate(warmup_config(6), workdir)
    assert losses(workdir) == losses(reference)
    assert resumed["params_sha256"] == summary["params_sha256"]


def _saved_steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(s) for s in os.listdir(directory))


def test_a_loss_that_explodes_while_finite_stops_the_run(tmp_path):
  """A rate of 1e3 from step 5 on: step 5's update takes the loss from
  about 2 to about 3e4, every number finite, and the run stops at step 6,
  before saving it; checkpoint 4 holds the state whose loss was 2."""
  workdir = str(tmp_path)
  sane = small_config(steps=4, checkpoint_every_steps=2)
  digest = train.train_and_evaluate(sane, workdir)["params_sha256"]
  first = losses(workdir)[1]
  diverging = small_config(steps=8, checkpoint_every_steps=2)
  diverging.optimizer.learning_rate = 1e3
  with pytest.raises(FloatingPointError) as error:
    train.train_and_evaluate(diverging, workdir)
  message = str(error.value)
  assert "at step 6 exceeds config.divergence_factor=1000 times the" in message
  assert "checkpoint 4 holds the last good state saved" in message
  assert "lower config.optimizer.learning_rate" in message
  loss = float(message.split("the loss ")[1].split(" ")[0])
  start = float(message.split("start of training, ")[1].split(":")[0])
  assert np.isfinite(loss) and loss > 1000 * start
  # The reference is step 1's loss, saved in checkpoint 4 and restored.
  assert start == pytest.approx(first, rel=1e-5)
  assert _saved_steps(workdir) == [2, 4]
  # The checkpoint left is the sane run's: resumed with no step left to
  # take, it gives back the same params.
  assert train.train_and_evaluate(sane, workdir)["params_sha256"] == digest


def _guard_trips(loss_sequence, factor=1e3):
  """The steps that the train step's divergence guard flags, for these
  losses one after another."""
  from train import steps  # pylint: disable=g-import-not-at-top

  start, flagged = np.float32(np.inf), []
  for step, loss in enumerate(loss_sequence, start=1):
    metrics = {"loss": np.float32(loss)}
    _, metrics = steps._guard(  # pylint: disable=protected-access
        None,
        None,
        metrics,
        skip_nonfinite=False,
        divergence_factor=factor,
        loss_start=start,
    )
    start = metrics["loss_start"]
    if metrics["diverged"]:
      flagged.append(step)
  return flagged


def test_the_divergence_guard_cannot_stop_a_loss_that_nears_zero():
  """The default config over a long run: the loss falls from 2.47 to 6e-5,
  then one batch gives 0.132, 2000 times that minimum but below where the
  run started. A guard against the running minimum stopped such runs; one
  against the loss at the start of training lets them be, and still stops
  a loss that grows past its start."""
  healthy = [*np.geomspace(2.47, 6.25e-5, 1396), 0.132, 1e-4]
  assert _guard_trips(healthy) == []
  assert _guard_trips(healthy, factor=2.0) == []
  assert _guard_trips([2.3, 2.0, 50.0, 3e4, 2.0]) == [4]
  # A first step that is skipped (non-finite) sets no reference.
  assert _guard_trips([np.nan, 2.3, 3e3]) == [3]


@pytest.mark.slow
def test_skip_mode_skips_a_diverged_step_keeping_the_state(tmp_path):
  """With a rate of 1e3 every step after the first diverges: each is
  skipped, and the state stays the one the first step made."""
  config = small_config(steps=4, nonfinite="skip", max_skipped_fraction=1.0)
  config.optimizer.learning_rate = 1e3
  summary = train.train_and_evaluate(config, str(tmp_path / "four"))
  train_lines, _ = read_metrics(str(tmp_path / "four"))
  assert [l["skipped"] for l in train_lines] == [0.0, 1.0, 1.0, 1.0]
  assert all(np.isfinite(l["loss"]) for l in train_lines)
  one = train.train_and_evaluate(
      small_config(
          steps=1,
          nonfinite="skip",
          max_skipped_fraction=1.0,
          optimizer={"learning_rate": 1e3},
      ),
      str(tmp_path / "one"),
  )
  assert summary["params_sha256"] == one["params_sha256"]
  # With the guard off, the same steps are taken.
  config.divergence_factor = 0
  unguarded = train.train_and_evaluate(config, str(tmp_path / "off"))
  train_lines, _ = read_metrics(str(tmp_path / "off"))
  assert [l["skipped"] for l in train_lines] == [0.0] * 4
  assert unguarded["params_sha256"] != summary["params_sha256"]


def test_a_run_that_skips_too_many_steps_counts_them_and_fails(tmp_path):
  """A rate of 1e3 with nonfinite="skip": every step after the first is
  skipped. The summary counts them, the count survives a resume, and a run
  past config.max_skipped_fraction fails once its checkpoint is saved."""
  from train import loop  # pylint: disable=g-import-not-at-top

  workdir = str(tmp_path)
  config = small_config(steps=2, nonfinite="skip", max_skipped_fraction=1.0)
  config.optimizer.learning_rate = 1e3
  assert train.train_and_evaluate(config, workdir)["skipped_steps"] == 1
  config.num_train_steps, config.max_skipped_fraction = 4, 0.5
  with pytest.raises(loop.TooManySkipped) as error:
    train.train_and_evaluate(config, workdir)
  assert str(error.value).startswith(
      "config.nonfinite='skip' skipped 3 of the run's 4 steps (75%), more"
      " than config.max_skipped_fraction=0.5"
  )
  assert error.value.summary["skipped_steps"] == 3
  assert "skipped steps" in metrics_lib.format_summary(error.value.summary)
  assert _saved_steps(workdir)[-1] == 4


def test_params_digest_reads_each_slice_once_and_plain_arrays_alike():
  import hashlib  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  x = np.arange(2 * NUM_DEVICES, dtype=np.float32).reshape(NUM_DEVICES, 2)
  expected = hashlib.sha256(x.tobytes()).hexdigest()
  replicated = jax.device_put(x, NamedSharding(mesh, P()))
  sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  for tree in ({"w": replicated}, {"w": sharded}, {"w": x}, [x]):
    assert metrics_lib.params_digest(tree) == expected
