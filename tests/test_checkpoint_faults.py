"""Damaged checkpoints and logs, as a resumed run meets them."""

import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
from flax import nnx
import optax
import orbax.checkpoint as ocp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acp_jax
from tests import helpers
from tests import test_multihost
from tests.conftest import NUM_DEVICES
from tests.test_train import losses
from tests.test_train import read_metrics
from tests.test_train import small_config
from acp_jax import checkpoint as acp_checkpoint
from train import checkpoint
from train import checks
from train import data as data_lib
from train import metrics as metrics_lib
from train import train

# orbax leaves its other reads' coroutines unfinished when one read fails.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)

# Checkpoints after steps 3 and 4: the fallback resumes an odd step, where
# ACP-SGD's state is in its Q phase.
STEPS = 4


def config():
  return small_config(steps=STEPS, checkpoint_every_steps=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run, copied by each test that damages it."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  summary = train.train_and_evaluate(config(), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "3",
      "4",
  ]
  return workdir, summary


def _copy(reference, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  return workdir


def _data_file(checkpoint_dir) -> str:
  """The largest file of array chunks in a checkpoint."""
  chunks = os.path.join(checkpoint_dir, "state", "ocdbt.process_0", "d")
  return max(
      (os.path.join(chunks, name) for name in os.listdir(chunks)),
      key=os.path.getsize,
  )


def _flip_bytes(path):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    middle = len(data) // 2
    data[middle - 200 : middle + 200] = bytes(
        b ^ 0xFF for b in data[middle - 200 : middle + 200]
    )
    f.seek(0)
    f.write(data)


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


DAMAGES = {
    "flipped bytes": _flip_bytes,
    "truncated": _truncate,
    "deleted": os.remove,
}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.slow
def test_damaged_latest_checkpoint_resumes_from_the_one_before(
    damage, reference, tmp_path, caplog
):
  workdir = _copy(reference, tmp_path)
  latest = os.path.join(workdir, "checkpoints", str(STEPS))
  DAMAGES[damage](_data_file(latest))
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(config(), workdir)
  assert f"checkpoint {latest} is damaged" in caplog.text
  assert losses(workdir) == losses(reference[0])  # floats compared exactly
  assert summary["params_sha256"] == reference[1]["params_sha256"]
  # The damaged one is kept aside; the step was saved again in its place.
  names = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  assert names[:2] == ["3", "4"] and names[2].startswith("4.damaged-")
  assert len(names) == 3


def test_cut_short_metrics_line_is_dropped_and_the_run_resumes(
    reference, tmp_path, caplog
):
  """A run killed while writing step 4's line, before saving step 4."""
  workdir = _copy(reference, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    lines = f.readlines()
  with open(path, "w") as f:
    f.writelines(lines[:3] + [lines[3][: len(lines[3]) // 2]])
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config(), workdir)
  assert f"{path}, line 4 is not JSON" in caplog.text
  train_lines, eval_lines = read_metrics(workdir)
  assert [l["step"] for l in train_lines] == list(range(1, STEPS + 1))
  assert losses(workdir) == losses(reference[0])
  # Equal but for the seconds each process took, which no two runs share.
  untimed = lambda lines: [
      {k: v for k, v in l.items() if k != "train_seconds"} for l in lines
  ]
  assert untimed(eval_lines) == untimed(read_metrics(reference[0])[1])


def test_damaged_metrics_line_before_the_last_is_refused(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
  with pytest.raises(ValueError, match=rf"{path}, line 2 is not JSON"):
    metrics_lib.MetricsLog(str(tmp_path), resume_step=3)


RUN = {
    "compressor": {"name": "topk_sgd", "args": {"density": 0.1}},
    "devices": NUM_DEVICES,
    "params": {"['w']": [64, 256]},
}


def _state(seed=0):
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  # Chunks of 8 KiB: stored in data files, not inline in the index.
  w = np.random.default_rng(seed).normal(size=(64, 256)).astype(np.float32)
  return {
      "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
      "step": jax.device_put(np.int32(seed), NamedSharding(mesh, P())),
  }


def _saved(directory, steps, keep=0):
  ckpt = checkpoint.Checkpointer(str(directory), keep=keep, run=RUN)
  for step in steps:
    ckpt.save(step, _state(step), {"step": step})
  return ckpt


def _assert_restored(restored, step):
  state, record = restored
  assert record == {"step": step}
  sums = acp_checkpoint.checksums
  assert sums(state) == sums(_state(step))


def test_checkpoint_of_another_run_is_refused_before_reading_arrays(
    tmp_path,
):
  _saved(tmp_path, [1]).close()
  # Were any array read, this would be a damaged checkpoint instead.
  os.remove(_data_file(tmp_path / "1"))
  other = dict(RUN, compressor={"name": "sign_sgd", "args": {}}, devices=4)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=0, run=other)
  with pytest.raises(ValueError) as error:
    ckpt.restore_latest(_state())
  message = str(error.value)
  assert f"checkpoint {tmp_path / '1'} was saved with" in message
  assert "compressor.name='topk_sgd', this run has 'sign_sgd'" in message
  assert "compressor.args.density=0.1, this run has none" in message
  assert "devices=8, this run has 4" in message
  assert "params" not in message  # equal keys are not listed


@pytest.mark.parametrize("recorded", [1.0, 0.5])
def test_a_run_that_recorded_a_retired_error_decay(recorded, tmp_path):
  """The trainer's configs of older versions held acp_sgd's error_decay: at
  1 the run resumes as today's, another value is refused."""
  args = {"rank": 4, "error_decay": recorded}
  old = dict(RUN, compressor={"name": "acp_sgd", "args": args})
  saved = checkpoint.Checkpointer(str(tmp_path), keep=0, run=old)
  saved.save(1, _state(1), {"step": 1})
  saved.close()
  now = dict(RUN, compressor={"name": "acp_sgd", "args": {"rank": 4}})
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=0, run=now)
  if recorded != 1:
    with pytest.raises(ValueError, match=r"error_decay=0\.5, an option this"):
      ckpt.restore_latest(_state())
    return
  _assert_restored(ckpt.restore_latest(_state()), 1)


def test_readable_arrays_that_differ_from_their_checksums_fall_back(
    tmp_path, caplog
):
  """Checkpoint 2's files replaced by checkpoint 3's: every file reads."""
  ckpt = _saved(tmp_path, [1, 2, 3])
  shutil.rmtree(tmp_path / "2" / "state")
  shutil.copytree(tmp_path / "3" / "state", tmp_path / "2" / "state")
  shutil.rmtree(tmp_path / "3")
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=0, run=RUN)
  with caplog.at_level(logging.WARNING):
    _assert_restored(ckpt.restore_latest(_state()), 1)
  assert f"checkpoint {tmp_path / '2'} is damaged: checksums differ" in (
      caplog.text
  )


def test_missing_record_falls_back(tmp_path, caplog):
  ckpt = _saved(tmp_path, [1, 2])
  os.remove(tmp_path / "2" / "record" / "metadata")
  with caplog.at_level(logging.WARNING):
    _assert_restored(ckpt.restore_latest(_state()), 1)
  assert f"checkpoint {tmp_path / '2'} is damaged: its record" in caplog.text


def test_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(tmp_path):
  ckpt = _saved(tmp_path, [1, 2])
  for step in (1, 2):
    _truncate(_data_file(tmp_path / str(step)))
  with pytest.raises(
      checks.Refused, match=f"none of the 2 checkpoints in {tmp_path} verifies"
  ):
    ckpt.restore_latest(_state())
  # Nothing is set aside when nothing could be resumed.
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]


@pytest.mark.slow
def test_the_command_line_refuses_a_workdir_in_one_line(tmp_path):
  """Another run's settings, then every checkpoint damaged: each refusal is
  its one line after the damaged checkpoints' warnings, with no traceback,
  nor those of the reads orbax abandons, and nothing set aside."""
  checkpoints = tmp_path / "checkpoints"

  def run(*overrides):
    return helpers.run_module(
        "train",
        "--config=configs/default.py",
        f"--workdir={tmp_path}",
        "--num_cpu_devices=2",
        "--config.model.width=8",
        "--config.checkpoint_every_steps=1",
        *overrides,
        timeout=300,
    )

  done = run("--config.num_train_steps=2")
  assert done.returncode == 0, done.stderr[-3000:]
  refused = run("--config.num_train_steps=4", "--config.compressor.name=ssgd")
  assert refused.returncode == 1
  (line,) = refused.stderr.splitlines()
  assert line.startswith(f"checkpoint {checkpoints / '2'} was saved with")
  assert "compressor.name='acp_sgd', this run has 'ssgd'. Resume" in line
  for step in ("1", "2"):
    chunks = checkpoints / step / "state" / "ocdbt.process_0" / "d"
    for name in os.listdir(chunks):
      _truncate(chunks / name)
  refused = run("--config.num_train_steps=4")
  assert refused.returncode == 1
  *warnings, line = refused.stderr.splitlines()
  assert line.startswith(f"none of the 2 checkpoints in {checkpoints} verifies")
  assert len(warnings) == 2, refused.stderr[-3000:]
  assert all("is damaged: its arrays cannot be read" in w for w in warnings)
  assert sorted(os.listdir(checkpoints)) == ["1", "2"]


def test_empty_directory_starts_from_scratch(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2, run=RUN)
  assert ckpt.restore_latest(_state()) is None


def test_failed_save_keeps_the_last_good_checkpoint(tmp_path):
  ckpt = _saved(tmp_path, [1], keep=1)
  with pytest.raises(TypeError, match="not JSON serializable"):
    ckpt.save(2, _state(2), {"step": 2, "data": object()})
  _assert_restored(ckpt.restore_latest(_state()), 1)
  ckpt.save(2, _state(2), {"step": 2})
  assert ckpt.restore_latest(_state())[1]["step"] == 2
  assert "1" not in os.listdir(tmp_path)  # deleted once 2 was complete


def test_checksums_follow_every_byte_and_position():
  state = _state()
  sums = acp_checkpoint.checksums(state)
  assert acp_checkpoint.checksums(_state()) == sums
  assert set(sums) == {"['step']", "['w']"}
  w = np.asarray(state["w"])
  # Independent of the layout: the same values on one device.
  on_one_device = acp_checkpoint.checksums({"w": jnp.asarray(w)})
  assert on_one_device["['w']"] == sums["['w']"]
  one_byte = w.copy()
  one_byte.reshape(-1).view(np.uint8)[37] ^= 1
  swapped = w.copy()
  swapped[[2, 9]] = swapped[[9, 2]]
  for changed in (one_byte, swapped):
    now = acp_checkpoint.checksums(dict(state, w=jnp.asarray(changed)))
    assert now["['step']"] == sums["['step']"]
    assert now["['w']"] != sums["['w']"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep": -1, "run": RUN}, "keep must be a non-negative int, got -1"),
        ({"keep": 1, "run": {"mesh": object()}}, "run must be JSON"),
    ],
)
def test_bad_arguments_are_named(kwargs, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    checkpoint.Checkpointer(str(tmp_path), **kwargs)


# ``python -m train`` in which process 1 cannot read checkpoint 6's arrays,
# as when a shard that only it reads is damaged.
_PROCESS_1_FAILS_ON_6 = """
import runpy, sys
import orbax.checkpoint as ocp

if "--process_id=1" in sys.argv:
  restore = ocp.StandardCheckpointHandler.restore

  def failing(self, directory, *args, **kwargs):
    if directory.parent.name == "6":
      raise OSError(f"cannot read {directory}")
    return restore(self, directory, *args, **kwargs)

  ocp.StandardCheckpointHandler.restore = failing
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_processes_agree_to_skip_what_one_cannot_read(tmp_path):
  workdir = str(tmp_path)

  def run(*command):
    return test_multihost._finish(
        helpers.launch(
            [*command, "--workdir", workdir, *test_multihost.ARGS]
            + ["--num_cpu_devices=2"],
            2,
            stderr=subprocess.STDOUT,
        )
    )

  run("-m", "train")  # checkpoints 3 and 6
  reference = test_multihost._losses(workdir)
  outputs = run("-c", _PROCESS_1_FAILS_ON_6)
  damaged = f"checkpoint {os.path.join(workdir, 'checkpoints', '6')} is damaged"
  assert f"{damaged}: its arrays cannot be read: OSError" in outputs[1]
  assert f"{damaged}: process 1 could not read it" in outputs[0]
  assert test_multihost._losses(workdir) == reference
  assert test_multihost._digest(outputs[0]) == test_multihost._digest(
      outputs[1]
  )


def _flip_bit_in(path, text, bit):
  """Flips ``bit`` of the first byte of ``text``'s one occurrence in the
  file at ``path``, as a failing disk would."""
  with open(path, "rb") as f:
    data = bytearray(f.read())
  assert data.count(text.encode()) == 1, text
  data[data.index(text.encode())] ^= 1 << bit
  with open(path, "wb") as f:
    f.write(data)


# One flipped bit in checkpoint 4's record: the step (4 -> 0), the data
# position (256 -> 356) or the run identity ('acp_sgd' -> 'acp_sge').
RECORD_FLIPS = {
    "step": ('4, "data"', 2),
    "data position": ('256}', 0),
    "run identity": ('d", "args"', 0),
}


@pytest.mark.parametrize("field", RECORD_FLIPS)
def test_flipped_bit_in_a_record_falls_back_to_the_one_before(
    field, reference, tmp_path, caplog
):
  workdir = _copy(reference, tmp_path)
  latest = os.path.join(workdir, "checkpoints", str(STEPS))
  _flip_bit_in(os.path.join(latest, "record", "metadata"), *RECORD_FLIPS[field])
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(config(), workdir)
  assert f"checkpoint {latest} is damaged: its record differs" in caplog.text
  assert losses(workdir) == losses(reference[0])
  assert summary["params_sha256"] == reference[1]["params_sha256"]


def test_another_momentum_is_refused_naming_the_key_and_the_fix(
    reference, tmp_path
):
  """Momentum 0 keeps no trace in the optimizer state: another structure,
  refused naming the config key, saved and now, not called damaged."""
  workdir = _copy(reference, tmp_path)
  before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  other = config()
  other.optimizer.sgd.momentum = 0.0
  with pytest.raises(ValueError) as error:
    train.train_and_evaluate(other, workdir)
  first = str(error.value).splitlines()[0]
  assert "config.optimizer.sgd.momentum=0.9, this run has 0.0" in first
  assert "Resume with the saved value" in first
  assert "saved from another state" in str(error.value)
  assert "damaged" not in str(error.value)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before


def test_resume_where_the_data_would_differ_is_refused(
    reference, tmp_path, monkeypatch
):
  """Step 4's data position, as a dataset of another size would give it."""
  workdir = _copy(reference, tmp_path)
  position = data_lib.Loader.position
  monkeypatch.setattr(
      data_lib.Loader,
      "position",
      lambda self, step: dict(position(self, step), epoch=1),
  )
  with pytest.raises(ValueError, match="the dataset changed"):
    train.train_and_evaluate(config(), workdir)


def test_checkpoints_that_is_a_file_fails_at_start(tmp_path):
  (tmp_path / "checkpoints").write_text("")
  with pytest.raises(ValueError, match="must be a directory for the"):
    train.train_and_evaluate(config(), str(tmp_path))
  assert not (tmp_path / "metrics.jsonl").exists()  # not a step was taken


def test_set_asides_of_one_step_within_a_second_never_collide(
    tmp_path, monkeypatch
):
  monkeypatch.setattr(checkpoint.time, "strftime", lambda _: "20260101-000000")
  ckpt = _saved(tmp_path, [1])
  for _ in range(2):  # step 2 saved, damaged and set aside twice
    ckpt.save(2, _state(2), {"step": 2})
    _truncate(_data_file(tmp_path / "2"))
    _assert_restored(ckpt.restore_latest(_state()), 1)
  assert sorted(os.listdir(tmp_path)) == [
      "1",
      "2.damaged-20260101-000000",
      "2.damaged-20260101-000000-2",
  ]


def test_set_aside_checkpoints_are_kept_to_a_bound(tmp_path, monkeypatch):
  stamps = iter(f"20260101-00000{i}" for i in range(9))
  monkeypatch.setattr(checkpoint.time, "strftime", lambda _: next(stamps))
  ckpt = _saved(tmp_path, [1])
  for step in range(2, 3 + checkpoint.KEEP_DAMAGED):
    ckpt.save(step, _state(step), {"step": step})
    _truncate(_data_file(tmp_path / str(step)))
    _assert_restored(ckpt.restore_latest(_state()), 1)
  damaged = sorted(n for n in os.listdir(tmp_path) if ".damaged-" in n)
  # The newest KEEP_DAMAGED of the 4 set aside, each of its own stamp.
  assert damaged == [
      f"{step}.damaged-20260101-00000{step - 2}"
      for step in range(3, 3 + checkpoint.KEEP_DAMAGED)
  ]


def _linked(tmp_path):
  """Checkpoints 1 and 2, with 1 moved out and linked back."""
  root, outside = tmp_path / "checkpoints", tmp_path / "outside"
  outside.mkdir()
  _saved(root, [1, 2]).close()
  shutil.move(root / "1", outside / "1")
  os.symlink(outside / "1", root / "1")
  return root, outside


def test_a_symlinked_checkpoint_is_never_followed(
    tmp_path, caplog, monkeypatch
):
  monkeypatch.setattr(checkpoint.time, "strftime", lambda _: "20260101-000000")
  root, outside = _linked(tmp_path)
  shutil.copytree(root / "2", outside / "3")
  os.symlink(outside / "3", root / "3")  # the latest, outside the workdir
  ckpt = checkpoint.Checkpointer(str(root), keep=2, run=RUN)
  with caplog.at_level(logging.WARNING):
    _assert_restored(ckpt.restore_latest(_state()), 2)
  assert f"checkpoint {root / '3'} is a symbolic link: not followed" in (
      caplog.text
  )
  ckpt.save(3, _state(3), {"step": 3})  # not in the way of the new 3
  assert sorted(os.listdir(root)) == [
      "1.link-20260101-000000",
      "2",
      "3",
      "3.link-20260101-000000",
  ]
  assert sorted(os.listdir(outside)) == ["1", "3"]


def test_rotation_removes_a_symlinked_old_checkpoint_not_its_target(
    tmp_path,
):
  root, outside = _linked(tmp_path)
  ckpt = checkpoint.Checkpointer(str(root), keep=2, run=RUN)
  ckpt.save(3, _state(3), {"step": 3})
  assert sorted(os.listdir(root)) == ["2", "3"]
  assert sorted(os.listdir(outside / "1")) == sorted(os.listdir(root / "2"))


_FULL_DISK = """
import os, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.getcwd())
from tests import test_checkpoint_faults as t
from train import checkpoint
root = sys.argv[1]
ckpt = t._saved(root, [1], keep=1)
filler = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT)
for block in (4096, 1):  # the rest of the disk
  try:
    while True:
      os.write(filler, b"0" * block)
  except OSError:
    pass
os.close(filler)
try:
  ckpt.save(2, t._state(2), {"step": 2})
except OSError as e:
  print("ERROR:", e)
os.remove(os.path.join(root, "filler"))
t._assert_restored(ckpt.restore_latest(t._state()), 1)
print("LEFT:", sorted(os.listdir(root)))
"""


@pytest.mark.slow
def test_a_full_disk_gives_one_line_and_keeps_the_last_checkpoint(tmp_path):
  if shutil.which("unshare") is None or subprocess.run(
      ["unshare", "-rm", "true"], capture_output=True
  ).returncode:
    pytest.skip("needs unshare -rm to mount a small tmpfs")
  mount = tmp_path / "disk"
  mount.mkdir()
  script = tmp_path / "full_disk.py"
  script.write_text(_FULL_DISK)
  # A 1 MiB file system of its own, in a user and mount namespace.
  out = subprocess.run(
      [
          "unshare",
          "-rm",
          "sh",
          "-c",
          f"mount -t tmpfs -o size=1m tmpfs {mount} &&"
          f" {sys.executable} {script} {mount}",
      ],
      cwd=test_multihost.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  (error,) = [l for l in out.stdout.splitlines() if l.startswith("ERROR:")]
  assert (
      f"No space left on device: checkpoint 2 could not be written to {mount}"
      in error
  )
  assert "LEFT: ['1']" in out.stdout
  assert "Event loop is closed" not in out.stderr


# acp_jax.checkpoint, as a user's own loop meets it.


def _public_state(compressor, seed=0):
  """A DataParallel state of ``compressor`` with nonzero residuals."""
  dp = acp_jax.DataParallel(compressor, helpers.mesh())
  params = {"w": jnp.ones((64, 256))}
  state = dp.chain(optax.sgd(0.1)).init(params)
  error = state.comm.error["w"]
  noise = np.random.default_rng(seed).normal(size=error.shape)
  noise = jax.device_put(noise.astype(np.float32), error.sharding)
  comm = state.comm._replace(error={"w": noise})
  return dp, state._replace(comm=comm)


def test_public_restore_refuses_flipped_bytes_naming_path_and_array(tmp_path):
  dp, state = _public_state(acp_jax.topk_sgd(0.1))
  path = tmp_path / "ckpt"
  acp_checkpoint.save(path, state, compressor=dp.compressor)
  restored = acp_checkpoint.restore(path, state, compressor=dp.compressor)
  assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)
  chunks = path / "ocdbt.process_0" / "d"
  _flip_bytes(max(chunks.iterdir(), key=os.path.getsize))
  with pytest.raises(acp_checkpoint.DamagedError) as error:
    acp_checkpoint.restore(path, state, compressor=dp.compressor)
  message = str(error.value)
  assert message.startswith(f"{path}: ") and "\n" not in message
  assert "comm.error" in message  # the array, by orbax's name or its path


def test_abandoned_reads_go_to_the_log_and_other_unraisables_do_not():
  """A damaged restore's abandoned reads printed up to hundreds of
  tracebacks after its one line: log_abandoned_reads hands them to a log
  (the trainer's debug log), and any other unraisable exception to the
  hook before it."""

  class Raises:
    def __init__(self, error):
      self.error = error

    def __del__(self):
      raise self.error

  logged, passed = [], []
  before = sys.unraisablehook
  sys.unraisablehook = lambda u: passed.append(u.exc_value)
  try:
    acp_checkpoint.log_abandoned_reads(logged.append)
    Raises(RuntimeError("Event loop is closed"))
    Raises(ValueError("not a read"))
  finally:
    sys.unraisablehook = before
  # (Reads abandoned by the tests before may arrive meanwhile, logged too.)
  mine = [t for t in logged if "raise self.error" in t]
  assert len(mine) == 1 and "Event loop is closed" in mine[0]
  assert all(
      t.startswith("an abandoned checkpoint read raised: ") for t in logged
  )
  assert [str(e) for e in passed] == ["not a read"]


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_public_restore_of_a_broken_file_is_one_line_naming_the_array(
    damage, tmp_path
):
  dp, state = _public_state(acp_jax.topk_sgd(0.1))
  path = tmp_path / "ckpt"
  acp_checkpoint.save(path, state, compressor=dp.compressor)
  chunks = path / "ocdbt.process_0" / "d"
  DAMAGES[damage](max(chunks.iterdir(), key=os.path.getsize))
  with pytest.raises(acp_checkpoint.DamagedError) as error:
    acp_checkpoint.restore(path, state, compressor=dp.compressor)
  message = str(error.value)
  assert message.startswith(f"{path}: its arrays cannot be read: array ")
  assert "comm.error" in message and "\n" not in message


# (saved, now): two compressors whose states have the same shapes.
SAME_SHAPES = {
    "sign_sgd -> topk_sgd": (
        lambda: acp_jax.sign_sgd(),
        lambda: acp_jax.topk_sgd(0.1),
        "name='sign_sgd', now 'topk_sgd'",
    ),
    "topk density": (
        lambda: acp_jax.topk_sgd(0.1),
        lambda: acp_jax.topk_sgd(0.2),
        "args.density=0.1, now 0.2",
    ),
    "acp_sgd seed": (
        lambda: acp_jax.acp_sgd(2),
        lambda: acp_jax.acp_sgd(2, seed=1),
        "args.seed=0, now 1",
    ),
    "comm_dtype": (
        lambda: acp_jax.power_sgd(2),
        lambda: acp_jax.power_sgd(2, comm_dtype=jnp.bfloat16),
        "args.comm_dtype=None, now 'bfloat16'",
    ),
    "warm-up into none": (
        lambda: acp_jax.acp_sgd(2, warmup_steps=3),
        lambda: acp_jax.acp_sgd(2),
        "args.warmup_steps=3, now 0",
    ),
    "numpy seed": (
        lambda: acp_jax.power_sgd(4, seed=np.int64(0)),
        lambda: acp_jax.power_sgd(4, seed=np.int64(7)),
        "args.seed=0, now 7",
    ),
}


@pytest.mark.parametrize(
    "saved, now",
    [
        ({"seed": np.int64(0)}, {"seed": 0}),
        ({"bucket_bytes": 1e6}, {"bucket_bytes": 2e6}),
        ({"axis_name": "data"}, {"axis_name": "batch"}),
    ],
)
def test_public_restore_takes_equal_settings_and_ones_the_state_ignores(
    saved, now, tmp_path, caplog
):
  """A NumPy seed equals the Python int of its value; the bucket size and
  the axis name do not change the state: restored, the latter with a line
  naming them."""
  mesh = jax.make_mesh(
      (NUM_DEVICES,), (now.get("axis_name", "data"),),
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  dp, state = _public_state(acp_jax.power_sgd(4, **saved))
  acp_checkpoint.save(tmp_path / "c", state, compressor=dp.compressor)
  compressor = acp_jax.power_sgd(4, **now)
  like = acp_jax.DataParallel(compressor, mesh).chain(optax.sgd(0.1)).init(
      {"w": jnp.ones((64, 256))}
  )
  with caplog.at_level(logging.WARNING, logger="acp_jax.checkpoint"):
    restored = acp_checkpoint.restore(
        tmp_path / "c", like, compressor=compressor
    )
  assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)
  (name,) = now
  # Only the library's lines: orbax's asyncio futures of an earlier test's
  # broken read may be collected, and logged, during this one.
  lines = [
      r.getMessage() for r in caplog.records if r.name == "acp_jax.checkpoint"
  ]
  if name == "seed":
    assert not lines
  else:
    (line,) = lines
    assert f"({name}=" in line and "do not change its state" in line
    assert "\n" not in line


@pytest.mark.parametrize("change", SAME_SHAPES)
def test_public_restore_refuses_another_compressor_of_the_same_shapes(
    change, tmp_path
):
  saved, now, message = SAME_SHAPES[change]
  dp, state = _public_state(saved())
  acp_checkpoint.save(tmp_path / "c", state, compressor=dp.compressor)
  dp_now, like = _public_state(now(), seed=1)
  assert acp_checkpoint.layout(like) == acp_checkpoint.layout(state) or (
      change == "warm-up into none"  # only the phase marker differs
  )
  with pytest.raises(ValueError, match="saved with another compressor") as e:
    acp_checkpoint.restore(tmp_path / "c", like, compressor=dp_now.compressor)
  assert message in str(e.value)
  with pytest.raises(ValueError, match=r"pass compressor= to restore"):
    acp_checkpoint.restore(tmp_path / "c", like)
  # Into the compressor it was saved with: the state as saved.
  fresh = _public_state(saved(), seed=1)[1]
  restored = acp_checkpoint.restore(
      tmp_path / "c", fresh, compressor=dp.compressor
  )
  assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)


@pytest.mark.parametrize("recorded", [1.0, 1, "none", None, 0.9])
def test_public_restore_of_a_retired_error_decay(
    recorded, tmp_path, monkeypatch, caplog
):
  """Older versions recorded ACP-SGD's error_decay: at the value that kept
  the residual whole it restores into today's compressor, with a note;
  any other is refused, naming the option."""
  dp, state = _public_state(acp_jax.acp_sgd(2))
  record = acp_checkpoint.compressor_record(dp.compressor)
  assert "error_decay" not in record["args"]
  record["args"]["error_decay"] = recorded
  with monkeypatch.context() as m:
    m.setattr(acp_checkpoint, "compressor_record", lambda _: record)
    acp_checkpoint.save(tmp_path / "c", state, compressor=dp.compressor)
  fresh = _public_state(acp_jax.acp_sgd(2), seed=1)[1]
  if recorded == 0.9:
    with pytest.raises(ValueError, match=r"error_decay=0\.9, an option this"):
      acp_checkpoint.restore(tmp_path / "c", fresh, compressor=dp.compressor)
    return
  with caplog.at_level(logging.WARNING, logger="acp_jax.checkpoint"):
    restored = acp_checkpoint.restore(
        tmp_path / "c", fresh, compressor=dp.compressor
    )
  assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)
  (note,) = [
      r.getMessage() for r in caplog.records if "error_decay" in r.getMessage()
  ]
  assert f"ignored acp_sgd's error_decay={recorded!r}" in note


@pytest.mark.parametrize("strict", [True, False])
def test_plain_orbax_into_a_fresh_init_fails_not_another_phase(
    strict, tmp_path
):
  """ACP-SGD with a warm-up: a fresh init is dense, the checkpoint in Q."""
  dp, fresh = _public_state(acp_jax.acp_sgd(2, warmup_steps=1))
  comm = fresh.comm
  state = fresh._replace(
      comm=comm._replace(
          phase=acp_jax.phase.marker_as(comm.phase, acp_jax.Phase.Q)
      )
  )
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)
  with ocp.StandardCheckpointer() as checkpointer:
    with pytest.raises(ValueError):
      checkpointer.restore(path, fresh, strict=strict)
    # Through acp_jax.checkpoint.target: phase Q, every array as saved.
    restored = checkpointer.restore(path, acp_checkpoint.target(path, fresh))
  assert restored.comm.next_phase is acp_jax.Phase.Q
  assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)


@pytest.mark.parametrize("change", SAME_SHAPES)
def test_public_save_records_the_compressor_unless_told_not_to(
    change, tmp_path
):
  """Without compressor=, a state of any of these compressors is not saved,
  so no checkpoint can be restored into another of the same shapes."""
  saved, now, _ = SAME_SHAPES[change]
  _, state = _public_state(saved())
  with pytest.raises(
      ValueError,
      match=r"^compressor= is missing: .*compressor=dp\.compressor\).* at"
      r" \[1\]\.comm$",
  ):
    acp_checkpoint.save(tmp_path / "c", (state.inner, state))
  assert not (tmp_path / "c").exists()
  # Told, with compressor=None: saved unchecked, restored into another
  # compressor of the same state type.
  acp_checkpoint.save(tmp_path / "c", state, compressor=None)
  _, like = _public_state(now(), seed=1)
  if type(like.comm) is type(state.comm) and change != "warm-up into none":
    restored = acp_checkpoint.restore(tmp_path / "c", like)
    assert acp_checkpoint.checksums(restored) == acp_checkpoint.checksums(state)


def test_public_restore_of_no_checkpoint_says_what_happened(tmp_path):
  dp, state = _public_state(acp_jax.topk_sgd(0.1))
  acp_checkpoint.save(tmp_path / "done", state, compressor=dp.compressor)
  # What a save killed before orbax's rename leaves: its temporary directory.
  os.rename(tmp_path / "done", tmp_path / "cut.orbax-checkpoint-tmp-1700000")
  (tmp_path / "empty").mkdir()
  cases = {
      "cut": "its save did not complete (orbax left"
      " cut.orbax-checkpoint-tmp-1700000 beside it, which is never restored);"
      " restore the checkpoint saved before it",
      "nowhere": "the path does not exist; pass the directory that"
      " acp_jax.checkpoint.save wrote",
      "empty": "the directory holds no orbax checkpoint",
  }
  for name, reason in cases.items():
    with pytest.raises(FileNotFoundError) as error:
      acp_checkpoint.restore(tmp_path / name, state, compressor=dp.compressor)
    message = str(error.value)
    assert message.startswith(f"no checkpoint at {tmp_path / name}: {reason}")
    assert "orbax itself" not in message


def test_public_restore_into_another_optimizer_names_its_structure(tmp_path):
  """optax.adam saved, optax.adamw now: the same arrays in other parts."""
  params = {"w": jnp.ones((4, 3))}
  acp_checkpoint.save(tmp_path / "c", (params, optax.adam(0.1).init(params)))
  like = (params, optax.adamw(0.1).init(params))
  assert acp_checkpoint.layout(like) == acp_checkpoint.layout(
      (params, optax.adam(0.1).init(params))
  )
  with pytest.raises(ValueError) as error:
    acp_checkpoint.restore(tmp_path / "c", like)
  message = str(error.value)
  assert "holds a state of another structure" in message
  assert "build like with the optimizer it was saved with" in message
  assert "[1]='tuple of 2', now 'tuple of 3'" in message
  assert "damaged" not in message.lower()


def test_public_restore_onto_fewer_devices_starts_the_compressor_afresh(
    tmp_path,
):
  """Residuals of 8 devices into a run on 4: the params and the momentum as
  saved, the compressor's state as the fresh init holds it."""
  dp, state = _public_state(acp_jax.topk_sgd(0.1))
  params = {"w": jnp.full((64, 256), 2.0)}
  tx = optax.sgd(0.1, momentum=0.9)
  trace = jax.tree.map(lambda p: p * 3.0, params)
  inner = (optax.TraceState(trace=trace), optax.EmptyState())
  state = dp.chain(tx).init(params)._replace(comm=state.comm, inner=inner)
  saved = (params, state)
  acp_checkpoint.save(tmp_path / "c", saved, compressor=dp.compressor)
  mesh4 = jax.make_mesh(
      (4,), (helpers.AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[:4],
  )
  dp4 = acp_jax.DataParallel(acp_jax.topk_sgd(0.1), mesh4)
  fresh_params = {"w": jnp.zeros((64, 256))}
  like = (fresh_params, dp4.chain(tx).init(fresh_params))
  with pytest.raises(ValueError) as error:
    acp_checkpoint.restore(tmp_path / "c", like, compressor=dp4.compressor)
  first = str(error.value).splitlines()[0]
  assert "saved float32[8, 64, 256]" in first
  assert "now float32[4, 64, 256]" in first
  assert "saved on 8 devices and this run has 4" in first
  assert "fresh=['[1].comm']" in first
  restored = acp_checkpoint.restore(
      tmp_path / "c", like, compressor=dp4.compressor, fresh=["[1].comm"]
  )
  sums = acp_checkpoint.checksums
  assert sums(restored[0]) == sums(params)
  assert sums(restored[1].inner) == sums(inner)
  assert restored[1].comm.error["w"].shape == (4, 64, 256)
  assert sums(restored[1].comm) == sums(like[1].comm)
  with pytest.raises(
      ValueError, match=r"no array of like lies under '\[1\]\.com'"
  ):
    acp_checkpoint.restore(
        tmp_path / "c", like, compressor=dp4.compressor, fresh=["[1].com"]
    )


def test_nnx_restore_onto_fewer_devices_names_its_fresh_path(tmp_path):
  """Under nnx.state the compressor's state keeps its fields but not its
  type: the refusal named no fresh path. It names the one that restores,
  and the params come back as saved."""

  def loop(devices):
    mesh = jax.make_mesh(
        (devices,), (helpers.AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )
    dp = acp_jax.DataParallel(acp_jax.topk_sgd(0.1), mesh)
    model = nnx.Linear(64, 32, rngs=nnx.Rngs(devices))
    tx = dp.chain(optax.sgd(0.1, momentum=0.9))
    return dp, model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  dp, model, optimizer = loop(NUM_DEVICES)
  acp_checkpoint.save(
      tmp_path / "c", nnx.state((model, optimizer)), compressor=dp.compressor
  )
  dp4, model4, optimizer4 = loop(NUM_DEVICES // 2)
  like = nnx.state((model4, optimizer4))
  with pytest.raises(ValueError) as error:
    acp_checkpoint.restore(tmp_path / "c", like, compressor=dp4.compressor)
  fresh = "[1]['opt_state']['comm']"
  assert f"fresh=[{fresh!r}]" in str(error.value).splitlines()[0]
  restored = acp_checkpoint.restore(
      tmp_path / "c", like, compressor=dp4.compressor, fresh=[fresh]
  )
  nnx.update((model4, optimizer4), restored)
  sums = acp_checkpoint.checksums
  assert sums(nnx.state(model4)) == sums(nnx.state(model))
  error = optimizer4.opt_state.comm.error
  assert error["kernel"].shape == (NUM_DEVICES // 2, 64, 32)
