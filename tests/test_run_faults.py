"""Faults around a run rather than inside a checkpoint: the workdir's files,
two runs on one workdir, processes that disagree, a state gone non-finite."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import helpers
from tests import test_faults
from tests import test_multihost
from tests.test_train import losses
from tests.test_train import small_config
from train import checkpoint
from train import experiment as experiment_lib
from train import metrics as metrics_lib
from train import runtime
from train import tokenizer as tokenizer_lib
from train import train


def test_a_metrics_symlink_out_of_the_workdir_is_refused(tmp_path):
  outside = tmp_path / "elsewhere.jsonl"
  lines = b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
  outside.write_bytes(lines)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").symlink_to(outside)
  with pytest.raises(ValueError, match=f"symlink to {outside}, outside"):
    train.train_and_evaluate(small_config(steps=2), str(workdir))
  assert outside.read_bytes() == lines


@pytest.mark.slow
def test_another_runs_checkpoints_copied_in_are_refused_naming_the_fix(
    tmp_path,
):
  """Workdir a logged steps 1-2 of seed 0; the checkpoints of a seed-1 run
  are copied over its own. Resuming a with seed 1 would log steps 3-4 of
  seed 1 after steps 1-2 of seed 0: refused, naming both runs."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  train.train_and_evaluate(small_config(steps=2), a)
  train.train_and_evaluate(small_config(steps=2, seed=1), b)
  with open(os.path.join(a, "metrics.jsonl")) as f:
    (run_a,) = {json.loads(line)["run"] for line in f}
  shutil.rmtree(os.path.join(a, "checkpoints"))
  shutil.copytree(os.path.join(b, "checkpoints"), os.path.join(a, "checkpoints"))
  with pytest.raises(ValueError) as error:
    train.train_and_evaluate(small_config(steps=4, seed=1), a)
  message = str(error.value)
  assert f"holds steps 1-2 of run {run_a}, but the checkpoint of step 2" in message
  assert "come from another run" in message
  assert "Move the checkpoints" in message
  # Its own workdir resumes, under the same run id.
  train.train_and_evaluate(small_config(steps=3, seed=1), b)
  with open(os.path.join(b, "metrics.jsonl")) as f:
    runs = [json.loads(line)["run"] for line in f]
  assert len(set(runs)) == 1 and runs[0] != run_a


def test_resuming_a_float32_run_under_jax_enable_x64_is_refused(tmp_path):
  """JAX_ENABLE_X64=1 would run the schedule in float64: the resumed run
  would not continue bit for bit. Refused, naming the variable."""
  train.train_and_evaluate(small_config(steps=1), str(tmp_path))
  jax.config.update("jax_enable_x64", True)
  try:
    with pytest.raises(ValueError) as error:
      train.train_and_evaluate(small_config(steps=2), str(tmp_path))
  finally:
    jax.config.update("jax_enable_x64", False)
  message = str(error.value)
  assert "was saved with JAX_ENABLE_X64=False, this run has True" in message
  assert "Resume with the same settings" in message


def test_a_checkpoint_of_a_later_format_is_named_as_version_skew(tmp_path):
  """A record re-sealed as a later version would write it, in a format this
  one cannot read (the older ones it reads: tests/test_releases.py).
  Refused as version skew, naming who wrote it and the formats this version
  reads, never called damaged nor set aside."""
  fields, by = {"format": 3, "written_by": "acp_jax 9.0"}, "acp_jax 9.0"
  from acp_jax import checkpoint as acp_checkpoint  # pylint: disable=g-import-not-at-top

  train.train_and_evaluate(small_config(steps=1), str(tmp_path))
  path = tmp_path / "checkpoints" / "1" / "record" / "metadata"
  record = json.loads(path.read_text())
  for key in ("digest", "format", "written_by"):
    record.pop(key)
  path.write_text(json.dumps(acp_checkpoint.sealed({**record, **fields})))
  with pytest.raises(ValueError) as error:
    train.train_and_evaluate(small_config(steps=2), str(tmp_path))
  message = str(error.value)
  assert f"was written by {by} in checkpoint format" in message
  assert f"this is {checkpoint.written_by()}, which reads formats 1, 2" in (
      message
  )
  assert "version skew, not damage" in message
  assert os.listdir(tmp_path / "checkpoints") == ["1"]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            b'{"loss": 1.0}\n',
            'is not a metrics record (a JSON object with an int "step")',
        ),
        (b'[2, 1.0]\n', "is not a metrics record"),
        (b'{"step": 2, "loss": "\xff"}\n', "is not UTF-8"),
    ],
)
def test_an_unreadable_metrics_line_is_named(line, message, tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1}\n' + line + b'{"step": 3}\n')
  with pytest.raises(ValueError, match=re.escape(f"{path}, line 2 {message}")):
    metrics_lib.MetricsLog(str(tmp_path), 1)


def test_a_damaged_tokenizer_file_is_named(tmp_path):
  path = str(tmp_path / "tokenizer.json")
  tokenizer_lib.train(["to be or not to be"] * 10, vocab_size=32).save(path)
  with open(path, "rb") as f:
    text = f.read()
  with open(path, "wb") as f:
    f.write(text[: len(text) // 2])
  with pytest.raises(ValueError, match=f"the tokenizer {path} cannot be read"):
    tokenizer_lib.load(path)


def _huge_first_kernel(init_state):
  """``init_state`` whose first conv kernel is scaled by 1e19: the params
  stay finite (norm 1.5e19), and so do the loss, the gradients and the
  update, but the first BatchNorm's batch variance overflows float32."""

  def init(experiment):
    state = init_state(experiment)
    params = jax.tree.map(lambda x: x, state.params)
    conv = params["layers"][0]["conv"]
    conv["kernel"] = conv["kernel"] * 1e19
    return state._replace(params=params)

  return init


def _all_finite(tree):
  return all(np.isfinite(x).all() for x in jax.tree.leaves(tree))


def test_a_non_finite_batch_norm_statistic_stops_the_run(
    tmp_path, monkeypatch
):
  monkeypatch.setattr(train, "init_state", _huge_first_kernel(train.init_state))
  with pytest.raises(FloatingPointError) as error:
    train.train_and_evaluate(small_config(steps=3), str(tmp_path))
  message = str(error.value)
  assert "an array of the state (BatchNorm statistics" in message
  assert "is not finite at step 1" in message
  # Nothing was ever saved: no "last good state" is claimed.
  assert "no checkpoint holds a finite state" in message
  assert "last good" not in message
  assert not os.listdir(tmp_path / "checkpoints")


@pytest.mark.slow
def test_skip_mode_keeps_batch_norm_statistics_finite(tmp_path, monkeypatch):
  init_state = _huge_first_kernel(train.init_state)
  monkeypatch.setattr(train, "init_state", init_state)
  config = small_config(
      steps=2,
      nonfinite="skip",
      checkpoint_every_steps=2,
      max_skipped_fraction=1.0,
  )
  train.train_and_evaluate(config, str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    lines = [l for l in map(json.loads, f) if "loss" in l]
  assert [l["skipped"] for l in lines] == [1.0, 1.0]
  # Each step would have made a variance inf: the saved state is the one
  # the run started from, finite.
  experiment = experiment_lib.build(config)
  start = jax.device_get(init_state(experiment))
  ckpt = checkpoint.Checkpointer(
      str(tmp_path / "checkpoints"),
      keep=0,
      run=train.run_identity(experiment, start),
  )
  saved, _ = ckpt.restore_latest(like=init_state(experiment))
  ckpt.close()
  saved = jax.device_get(saved)
  assert _all_finite(saved.batch_stats) and _all_finite(saved.opt_state)
  jax.tree.map(
      np.testing.assert_array_equal, saved.batch_stats, start.batch_stats
  )
  jax.tree.map(np.testing.assert_array_equal, saved.params, start.params)


def test_a_workdir_held_by_another_run_is_refused_naming_it(tmp_path):
  with runtime.WorkdirLock(str(tmp_path)):
    with pytest.raises(RuntimeError) as error:
      train.train_and_evaluate(small_config(steps=1), str(tmp_path))
  started = time.strftime("%Y-%m-%dT")
  assert (
      f"is in use by another run (pid {os.getpid()} on"
      f" {socket.gethostname()}, started {started}"
  ) in str(error.value)
  assert not os.path.exists(tmp_path / "metrics.jsonl")
  # Released on leaving: the same run now trains.
  summary = train.train_and_evaluate(small_config(steps=1), str(tmp_path))
  assert summary["step"] == 1


def test_a_lock_that_is_a_symlink_is_refused_naming_it_and_the_fix(tmp_path):
  target = tmp_path / "elsewhere"
  target.write_text("not the run's")
  lock = tmp_path / "run" / ".lock"
  lock.parent.mkdir()
  lock.symlink_to(target)
  with pytest.raises(ValueError) as error:
    with runtime.WorkdirLock(str(lock.parent)):
      pass
  first = str(error.value).splitlines()[0]
  assert first.startswith(f"{lock} is a symbolic link")
  assert f"remove it (rm {lock}) and run again" in first
  assert target.read_text() == "not the run's"


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_is_refused_and_a_dead_ones_lock_is_not(
    tmp_path,
):
  workdir = str(tmp_path / "run")
  # Long enough to be still training when the second run starts.
  first = test_faults._launch(workdir, "--num_cpu_devices=2", steps=10**6)
  try:
    test_faults._wait_for_step(workdir, 3, [first])
    second = test_faults._launch(workdir, "--num_cpu_devices=2", steps=6)
    ((_, err),) = helpers.finish([second], 300)
    assert second.returncode == 1, err[-3000:]
    assert f"in use by another run (pid {first.pid} on" in err
  finally:
    first.kill()  # as by SIGKILL: its lock file stays behind
    first.communicate()
  # The lock of a dead run holds nothing back, and the run is the one an
  # uninterrupted run makes: each step logged once, the same losses.
  rerun = test_faults._launch(workdir, "--num_cpu_devices=2", steps=6)
  reference = str(tmp_path / "reference")
  (out,) = helpers.finish([rerun], 300)
  assert rerun.returncode == 0, out[1][-3000:]
  helpers.finish(
      [test_faults._launch(reference, "--num_cpu_devices=2", steps=6)], 300
  )
  assert sorted(losses(workdir)) == list(range(1, 7))
  assert losses(workdir) == losses(reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--config.optimizer.learning_rate=0.2",
            "config.optimizer.learning_rate: process 0 has 0.1, process 1 has"
            " 0.2",
        ),
        (
            "--config.compressor.acp_sgd.rank=2",
            "config.compressor.acp_sgd.rank: process 0 has 4, process 1 has 2",
        ),
    ],
)
def test_processes_with_different_configs_refuse_before_any_step(
    override, message, tmp_path
):
  workdir = str(tmp_path / "run")
  address = f"127.0.0.1:{helpers.free_port()}"
  procs = [
      test_faults._multi(workdir, address, 0, steps=4),
      test_faults._multi(workdir, address, 1, override, steps=4),
  ]
  outs = helpers.finish(procs, 300)
  assert [p.returncode for p in procs] == [1, 1], outs[0][1][-3000:]
  for _, err in outs:
    assert "the processes of this run have different configs" in err
    assert message in err
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


_FULL_DISK_LOG = """
import errno, sys
from tensorboardX import event_file_writer
from train import metrics

def full(*args):
  raise OSError(errno.ENOSPC, "No space left on device")

log = metrics.TensorBoardLog(sys.argv[1], 0)
event_file_writer.EventsWriter.flush = full
try:
  log.write({"step": 7, "loss": 1.0})
except OSError as e:
  print("ERROR:", e)
log.close()
"""


def test_a_full_disk_under_the_tensorboard_log_is_one_line_naming_it(tmp_path):
  """Its writer's flush raising ENOSPC: one line naming the directory, and
  nothing more when the log is closed or at exit."""
  out = subprocess.run(
      [sys.executable, "-c", _FULL_DISK_LOG, str(tmp_path)],
      cwd=test_multihost.ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  (error,) = out.stdout.splitlines()
  assert error == (
      "ERROR: [Errno 28] No space left on device: step 7's TensorBoard"
      f" summaries could not be written to {tmp_path / 'tensorboard'}; the"
      " checkpoints saved before are kept as they were. Free some space and"
      " run again to resume."
  )
  assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_a_resume_never_deletes_another_runs_later_lines(tmp_path):
  """Run a logged steps 2 and 4; the step-1 checkpoint of run b replaces
  a's checkpoints. Resuming at step 1 would drop a's lines past it, which
  the lines kept (none) cannot show: refused, and the log is untouched."""
  a, b = tmp_path / "a", tmp_path / "b"
  train.train_and_evaluate(small_config(steps=4, log_every_steps=2), str(a))
  train.train_and_evaluate(small_config(steps=1, seed=1), str(b))
  before = (a / "metrics.jsonl").read_text()
  shutil.rmtree(a / "checkpoints")
  shutil.copytree(b / "checkpoints", a / "checkpoints")
  with pytest.raises(ValueError, match="come from another run"):
    train.train_and_evaluate(small_config(steps=4, seed=1), str(a))
  assert (a / "metrics.jsonl").read_text() == before


def test_a_fresh_run_moves_another_runs_log_aside(tmp_path, caplog):
  """A workdir with another run's log and no checkpoint: the new run logs
  afresh, and the old log is kept beside it, named in a warning."""
  old = [{"step": 1, "run": "old", "loss": 2.0}]
  (tmp_path / "metrics.jsonl").write_text(json.dumps(old[0]) + "\n")
  train.train_and_evaluate(small_config(steps=1), str(tmp_path))
  aside = tmp_path / "metrics.jsonl.run-old"
  assert [json.loads(l) for l in aside.read_text().splitlines()] == old
  new = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text()
         .splitlines()]
  assert {(l["step"], l["run"] == "old") for l in new} == {(1, False)}
  assert f"moved to {aside}" in caplog.text
