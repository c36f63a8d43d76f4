"""Two processes x two CPU devices, joined by jax.distributed on localhost."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300
ARGS = [
    "--config",
    os.path.join(ROOT, "configs", "default.py"),
    "--config.num_train_steps=6",
    "--config.batch_size=32",
    "--config.model.width=8",
    "--config.eval_every_steps=0",
    "--config.checkpoint_every_steps=3",
]


def _launch(workdir, *extra):
  return subprocess.Popen(
      [sys.executable, "-m", "train", "--workdir", workdir, *ARGS, *extra],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )


def _finish(procs) -> list[str]:
  """Each process's output, once all have succeeded."""
  outputs = [out for out, _ in helpers.finish(procs, TIMEOUT_S)]
  for proc, out in zip(procs, outputs):
    assert proc.returncode == 0, out[-3000:]
  return outputs


def _digest(output: str) -> str:
  return re.search(r"params sha256\s+([0-9a-f]{64})", output).group(1)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [l["loss"] for l in map(json.loads, f) if "loss" in l]


@pytest.mark.slow
def test_two_processes_end_with_identical_params(tmp_path):
  multi = str(tmp_path / "multi")
  outputs = _finish(
      helpers.launch(
          ["-m", "train", "--workdir", multi, *ARGS, "--num_cpu_devices=2"],
          2,
          stderr=subprocess.STDOUT,
      )
  )
  assert _digest(outputs[0]) == _digest(outputs[1])
  # The same global batches on one process with four devices.
  single = str(tmp_path / "single")
  (output,) = _finish([_launch(single, "--num_cpu_devices=4")])
  np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)
  assert len(_losses(multi)) == 6
