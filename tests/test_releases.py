"""Runs stopped by earlier releases resume with this one.

``tests/releases/COMMIT`` holds what ``tests/releases/make.py`` wrote at that
release: a library checkpoint of an NNX loop and a trainer workdir, each
stopped at step 3, with the release's own losses of steps 4-6. Where the
math is unchanged, this version continues them to the bit.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from flax import nnx

from acp_jax import checkpoint
from tests.releases import make

RELEASES = pathlib.Path(__file__).parent / "releases"
COMMITS = sorted(p.name for p in RELEASES.iterdir() if p.is_dir() and (
    p / "release.json").exists())
ROOT = RELEASES.parents[1]


def _expected(path):
  return json.loads((path / "losses.json").read_text())["loss"]


@pytest.mark.parametrize("commit", COMMITS)
def test_a_library_checkpoint_of_an_earlier_release_continues_exactly(
    commit, tmp_path
):
  saved = RELEASES / commit / "library"
  dp, model, optimizer, step = make.library_run()
  like = nnx.state((model, optimizer))
  restored = checkpoint.restore(
      str(saved / "step3"), like, compressor=dp.compressor
  )
  nnx.update((model, optimizer), restored)
  losses = [float(step(model, optimizer, *make.batch(i))) for i in range(3, 6)]
  assert losses == _expected(saved)


@pytest.mark.slow
@pytest.mark.parametrize("commit", COMMITS)
def test_a_trainer_workdir_of_an_earlier_release_resumes_exactly(
    commit, tmp_path
):
  saved = RELEASES / commit / "trainer"
  workdir = tmp_path / "workdir"
  shutil.copytree(saved / "workdir", workdir)
  done = subprocess.run(
      [sys.executable, "-m", "train", f"--workdir={workdir}",
       *make.TRAIN_ARGS, "--config.num_train_steps=6"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").open()]
  losses = {l["step"]: l["loss"] for l in lines if "loss" in l}
  assert [losses[s] for s in (4, 5, 6)] == _expected(saved)
