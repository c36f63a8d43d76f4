"""Damaged checkpoints and logs, as a resumed run meets them."""

import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests import helpers
from tests import test_multihost
from tests.conftest import NUM_DEVICES
from tests.test_train import losses
from tests.test_train import read_metrics
from tests.test_train import small_config
from train import checkpoint
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
  assert eval_lines == read_metrics(reference[0])[1]


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
  assert checkpoint.checksums(state) == checkpoint.checksums(_state(step))


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
      RuntimeError, match=f"none of the 2 checkpoints in {tmp_path} verifies"
  ):
    ckpt.restore_latest(_state())
  # Nothing is set aside when nothing could be resumed.
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]


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
  sums = checkpoint.checksums(state)
  assert checkpoint.checksums(_state()) == sums
  assert set(sums) == {"['step']", "['w']"}
  w = np.asarray(state["w"])
  # Independent of the layout: the same values on one device.
  assert checkpoint.checksums({"w": jnp.asarray(w)})["['w']"] == sums["['w']"]
  one_byte = w.copy()
  one_byte.reshape(-1).view(np.uint8)[37] ^= 1
  swapped = w.copy()
  swapped[[2, 9]] = swapped[[9, 2]]
  for changed in (one_byte, swapped):
    now = checkpoint.checksums(dict(state, w=jnp.asarray(changed)))
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
    address = f"127.0.0.1:{helpers.free_port()}"
    return test_multihost._finish(
        [
            subprocess.Popen(
                [sys.executable, *command, "--workdir", workdir]
                + test_multihost.ARGS
                + [
                    "--num_cpu_devices=2",
                    f"--coordinator_address={address}",
                    "--num_processes=2",
                    f"--process_id={i}",
                ],
                cwd=test_multihost.ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
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
