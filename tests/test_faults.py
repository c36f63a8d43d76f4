"""Faults as a user meets them: divergence, signals, a missing peer."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests import helpers
from tests.test_train import losses
from tests.test_train import small_config
from train import checkpoint
from train import experiment as experiment_lib
from train import metrics as metrics_lib
from train import runtime
from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_INTERRUPTED = 75


def saved_steps(workdir):
  """The steps of the completed checkpoints (orbax renames a save's
  temporary directory, ``N.orbax-checkpoint-tmp``, once it is complete)."""
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  return sorted(int(s) for s in names if s.isdigit())


def restored_params(workdir, config):
  experiment = experiment_lib.build(config)
  like = experiment_lib.init_state(experiment)
  ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, "checkpoints"),
      keep=config.keep_checkpoints,
      run=train.run_identity(experiment, like),
  )
  state, _ = ckpt.restore_latest(like=like)
  ckpt.close()
  return jax.device_get(state.params)


@pytest.mark.slow
def test_divergence_stops_before_saving_and_a_sane_rerun_resumes(tmp_path):
  workdir = str(tmp_path)
  train.train_and_evaluate(small_config(steps=4, checkpoint_every_steps=2), workdir)
  assert saved_steps(workdir) == [2, 4]
  # A checkpoint every step: the first non-finite step must not be saved.
  diverging = small_config(steps=30, checkpoint_every_steps=1)
  diverging.optimizer.learning_rate = 1e30
  with pytest.raises(FloatingPointError, match="is not finite at step 5") as e:
    train.train_and_evaluate(diverging, workdir)
  assert "checkpoint 4, checked finite, holds the last good state" in str(e.value)
  assert saved_steps(workdir) == [2, 4]
  params = restored_params(workdir, diverging)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  summary = train.train_and_evaluate(small_config(steps=8, checkpoint_every_steps=2), workdir)
  assert summary["step"] == 8 and np.isfinite(summary["loss"])


@pytest.mark.parametrize(
    "override, message",
    [
        ({"compressor.name": "sign_sgd"}, "compressor.name='topk_sgd', this run has 'sign_sgd'"),
        ({"compressor.topk_sgd.density": 0.5}, "compressor.args.density=0.1, this run has 0.5"),
        ({"model.width": 16}, "model.width=8, this run has 16"),
        ({"batch_size": 32}, "batch_size=64, this run has 32"),
        ({"seed": 1}, "seed=0, this run has 1"),
    ],
)
@pytest.mark.slow
def test_resuming_another_run_is_refused_naming_saved_and_now(
    override, message, tmp_path
):
  train.train_and_evaluate(small_config("topk_sgd", steps=2), str(tmp_path))
  config = small_config("topk_sgd", steps=4)
  for key, value in override.items():
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    train.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_skip_mode_keeps_the_state_finite(tmp_path):
  config = small_config(steps=6, nonfinite="skip", max_skipped_fraction=1.0)
  config.optimizer.learning_rate = 1e30
  summary = train.train_and_evaluate(config, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    skipped = [l["skipped"] for l in map(json.loads, f) if "skipped" in l]
  assert len(skipped) == 6 and sum(skipped) >= 1
  assert np.isfinite(summary["eval_loss"])
  params = restored_params(str(tmp_path), config)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_digest_takes_nan_replicas_as_equal():
  sharding = NamedSharding(helpers.mesh(), P())
  nan = jax.device_put(np.full(3, np.nan, np.float32), sharding)
  assert len(metrics_lib.params_digest({"w": nan})) == 64


# The default config with a learning rate that does not depend on the
# number of steps, so that runs of different lengths agree step by step.
_CONSTANT_RATE = """
import ml_collections
from configs import default


def get_config():
  config = default.get_config()
  config.schedule = ml_collections.ConfigDict(
      {"name": "constant", "warmup_steps": 0}
  )
  return config
"""


def _launch(workdir, *extra, steps=400, new_session=False):
  config = os.path.join(os.path.dirname(workdir), "constant_rate.py")
  with open(config, "w") as f:
    f.write(_CONSTANT_RATE)
  return subprocess.Popen(
      [
          sys.executable,
          "-m",
          "train",
          "--config",
          config,
          "--workdir",
          workdir,
          f"--config.num_train_steps={steps}",
          "--config.batch_size=32",
          "--config.model.width=8",
          "--config.eval_every_steps=0",
          "--config.checkpoint_every_steps=0",
          *extra,
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=new_session,  # a process group, as a terminal's
  )


def _wait_for_step(workdir, step, procs, timeout=300):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path):
      with open(path) as f:
        if sum(1 for _ in f) >= step:
          return
    for p in procs:
      assert p.poll() is None, p.communicate()[1][-3000:]
    time.sleep(0.05)
  raise TimeoutError(f"no step {step} in {path}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
)
def test_a_signal_saves_and_the_rerun_resumes_bitwise(signum, tmp_path):
  workdir = str(tmp_path / "run")
  proc = _launch(workdir)
  _wait_for_step(workdir, 3, [proc])
  sent = time.monotonic()
  proc.send_signal(signum)
  ((_, err),) = helpers.finish([proc], 300)
  assert time.monotonic() - sent < 10
  assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
  name = signal.Signals(signum).name
  stopped = int(err.split(f"stopped by {name} at step ")[1].split(";")[0])
  assert saved_steps(workdir) == [stopped]
  # The same command again, to a shorter end: the steps after the signal
  # match a run that was never stopped.
  end = stopped + 3
  helpers.finish([_launch(workdir, steps=end)], 300)
  reference = str(tmp_path / "reference")
  helpers.finish([_launch(reference, steps=end)], 300)
  assert losses(workdir) == losses(reference)


@pytest.mark.slow
def test_ctrl_c_with_data_workers_ends_with_the_trainers_line_alone(tmp_path):
  """Ctrl-C signals the terminal's whole process group, the data workers
  too: each printed its KeyboardInterrupt. The trainer saves, ends them and
  says so. (Python's resource tracker may still report the shared memory of
  the last batches, whose unlinking grain leaves to a thread that the exit
  does not wait for; the tracker then frees it.)"""
  workdir = str(tmp_path / "run")
  proc = _launch(workdir, "--config.data_workers=2", new_session=True)
  _wait_for_step(workdir, 3, [proc])
  os.killpg(proc.pid, signal.SIGINT)
  ((_, err),) = helpers.finish([proc], 120)
  assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
  assert "KeyboardInterrupt" not in err, err[-3000:]
  assert "stopped by SIGINT at step" in err.strip().splitlines()[0], err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_starting_ends_the_run_with_a_line(signum, tmp_path):
  """A signal within the first seconds (imports, compiling) ended the run
  with no line at all."""
  proc = _launch(str(tmp_path / "run"))
  time.sleep(1)  # within the imports
  proc.send_signal(signum)
  ((_, err),) = helpers.finish([proc], 120)
  assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
  assert err.strip().splitlines()[-1].startswith(
      f"stopped by {signal.Signals(signum).name} before training started"
  ), err[-3000:]


def test_sighup_asks_to_save_and_stop_as_sigterm_does():
  """A closed terminal sends SIGHUP: noted, the run saves at the next step
  boundary and says so, as with SIGTERM (the whole path, in a subprocess,
  is in the test above)."""
  def before(*_):
    pass

  previous = signal.signal(signal.SIGHUP, before)
  try:
    with runtime.StopRequests() as stops:
      assert not stops.should_stop(1)
      os.kill(os.getpid(), signal.SIGHUP)
      assert stops.should_stop(2)
      assert stops.signal_name == "SIGHUP"
    # The handler before is back once the run is over.
    assert signal.getsignal(signal.SIGHUP) is before
  finally:
    signal.signal(signal.SIGHUP, previous)
  message = str(runtime.Interrupted("SIGHUP", 2))
  assert message.startswith("stopped by SIGHUP at step 2; a checkpoint")


def _multi(workdir, address, i, *extra, steps=400):
  return _launch(
      workdir,
      "--num_cpu_devices=2",
      f"--coordinator_address={address}",
      "--num_processes=2",
      f"--process_id={i}",
      *extra,
      steps=steps,
  )


@pytest.mark.slow
def test_sigterm_stops_every_process_at_one_step_and_resumes(tmp_path):
  workdir = str(tmp_path / "multi")
  address = f"127.0.0.1:{helpers.free_port()}"
  procs = [_multi(workdir, address, i) for i in range(2)]
  _wait_for_step(workdir, 3, procs)
  procs[1].send_signal(signal.SIGTERM)  # one process told; both must stop
  outs = helpers.finish(procs, 300)
  assert [p.returncode for p in procs] == [EXIT_INTERRUPTED] * 2, outs[0][1][-3000:]
  steps = {int(err.split("at step ")[1].split(";")[0]) for _, err in outs}
  assert len(steps) == 1, steps
  (stopped,) = steps
  assert saved_steps(workdir) == [stopped]
  # Resumed to a shorter end, the losses match an uninterrupted 2-process
  # run exactly.
  end = stopped + 2
  address = f"127.0.0.1:{helpers.free_port()}"
  helpers.finish([_multi(workdir, address, i, steps=end) for i in range(2)], 300)
  reference = str(tmp_path / "reference")
  address = f"127.0.0.1:{helpers.free_port()}"
  helpers.finish(
      [_multi(reference, address, i, steps=end) for i in range(2)], 300
  )
  assert len(losses(workdir)) == end
  assert losses(workdir) == losses(reference)


@pytest.mark.slow
def test_a_missing_peer_fails_within_the_timeout(tmp_path):
  address = f"127.0.0.1:{helpers.free_port()}"
  start = time.monotonic()
  proc = _multi(str(tmp_path), address, 0, "--distributed_timeout_s=5")
  ((_, err),) = helpers.finish([proc], timeout=120)
  assert proc.returncode == runtime.EXIT_NOT_JOINED, err[-3000:]
  assert time.monotonic() - start < 60
  assert f"joining the coordinator at {address}" in err
  # The trainer's own last line, not JAX's abort.
  assert err.strip().splitlines()[-1].startswith(
      "process 0 of 2: the other processes did not all join the coordinator"
      f" at {address} within 5 s (--distributed_timeout_s), so no step ran."
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, causes",
    [
        # The collective fails; where the survivor waits on the dead peer
        # outside gloo (as in a checkpoint save's barrier), the watchdog
        # ends it instead. Either way the last line is the trainer's.
        (signal.SIGKILL, ("Gloo", "it waited 30 s")),
        (signal.SIGSTOP, ("it waited 30 s",)),  # it would wait forever
    ],
    ids=["killed", "stopped"],
)
def test_a_peer_killed_mid_run_ends_the_other_with_its_own_line(
    signum, causes, tmp_path
):
  """The survivor aborted inside gloo (rc -6), with JAX's dumps and no word
  of the checkpoint a rerun resumes from. (Process 0 killed takes the
  coordination service with it: JAX's client then aborts the others from
  its own thread, which no line of the trainer can precede.)"""
  workdir = str(tmp_path / "multi")
  address = f"127.0.0.1:{helpers.free_port()}"
  procs = [
      _multi(
          workdir,
          address,
          i,
          "--config.checkpoint_every_steps=5",
          "--distributed_timeout_s=30",
      )
      for i in range(2)
  ]
  try:
    _wait_for_step(workdir, 7, procs)
  finally:
    procs[1].send_signal(signum)
  sent = time.monotonic()
  try:
    ((_, err),) = helpers.finish(procs[:1], timeout=120)
  finally:
    procs[1].kill()
    procs[1].communicate()
  assert procs[0].returncode == runtime.EXIT_PEER_LOST, err[-3000:]
  assert time.monotonic() - sent < 90
  # The trainer's own last line, not JAX's abort: "during step N", or
  # where the signal lands in a save or an evaluation, "during the
  # checkpoint save (the evaluation) after step N".
  last = err.strip().splitlines()[-1]
  assert re.match(
      r"process 0 of 2: another process of the run stopped during"
      r" (the checkpoint save after |the evaluation after )?step \d+ ",
      last,
  ), last
  assert any(cause in last for cause in causes), last
  assert "Run the same command again" in last
  resumed = int(last.split("resumes from checkpoint ")[1].rstrip("."))
  assert resumed >= 5 and resumed in saved_steps(workdir)


def test_a_save_that_waits_on_a_silent_peer_ends_the_run_with_its_own_line(
    tmp_path,
):
  """A peer killed or frozen during a checkpoint save left the survivor
  waiting in the save until JAX's heartbeat aborted it (rc -6, no trainer
  line): the watchdog of the steps covers saves and evaluations too. Here
  a save that waits past --distributed_timeout_s stands for the peer."""
  workdir = str(tmp_path / "run")
  script = f"""
import time
from tests.test_train import small_config
from train import checkpoint, runtime, train
runtime._silent_peer_s = 2  # what a joined run's --distributed_timeout_s sets
checkpoint.Checkpointer.save = lambda *args, **kwargs: time.sleep(60)
train.train_and_evaluate(
    small_config(steps=4, checkpoint_every_steps=2), {workdir!r}
)
"""
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert proc.returncode == runtime.EXIT_PEER_LOST, proc.stderr[-3000:]
  assert time.monotonic() - start < 60
  last = proc.stderr.strip().splitlines()[-1]
  assert "stopped during the checkpoint save after step 2" in last, last
  assert "it waited 2 s (--distributed_timeout_s)" in last, last


@pytest.mark.slow
def test_a_workdir_per_process_is_refused_at_start(tmp_path):
  address = f"127.0.0.1:{helpers.free_port()}"
  procs = [_multi(str(tmp_path / f"p{i}"), address, i, steps=4) for i in range(2)]
  outs = helpers.finish(procs, timeout=120)
  assert [p.returncode for p in procs] == [1, 1]
  assert all("must be one directory shared by every process" in err for _, err in outs)
