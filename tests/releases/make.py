"""Writes the small checkpoints of a release that tests/test_releases.py
resumes with the current code.

Run from a checkout of the release, with this file copied beside it:

  python make.py OUT

OUT/library: a Flax NNX MLP trained 3 steps by ``DataParallel(acp_sgd(2))``
on 8 simulated devices and saved by ``acp_jax.checkpoint.save`` (its phase
is Q), and the release's own losses of steps 4-6 after restoring it.
OUT/trainer: the workdir of ``python -m train`` on the embedded default
stopped at step 3, and the release's own losses of steps 4-6 when the same
command resumes it. Only public calls that every release has are used.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import acp_jax
from acp_jax import checkpoint

TRAIN_ARGS = [
    "--config=configs/default.py",
    "--num_cpu_devices=8",
    "--config.model.width=4",
    "--config.batch_size=32",
    "--config.eval_every_steps=0",
    "--config.checkpoint_every_steps=3",
    "--config.log_every_steps=1",
    "--config.schedule.warmup_steps=0",
    "--config.compressor.acp_sgd.warmup_steps=0",
]


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(16, 32, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def batch(step):
  key = jax.random.fold_in(jax.random.key(0), step)
  x = jax.random.normal(key, (64, 16))
  return x, (jnp.sum(x[:, :4], axis=1) > 0).astype(jnp.int32) * 3


def library_run():
  """The model, optimizer and step of the library's loop."""
  mesh = jax.make_mesh(
      (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  dp = acp_jax.DataParallel(acp_jax.acp_sgd(rank=2), mesh)
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, dp.chain(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param
  )

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = dp.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  return dp, model, optimizer, step


def library(out):
  dp, model, optimizer, step = library_run()
  for i in range(3):
    float(step(model, optimizer, *batch(i)))
  path = os.path.join(os.path.abspath(out), "step3")
  checkpoint.save(path, nnx.state((model, optimizer)), compressor=dp.compressor)
  losses = [float(step(model, optimizer, *batch(i))) for i in range(3, 6)]
  with open(os.path.join(out, "losses.json"), "w") as f:
    json.dump({"steps": [4, 5, 6], "loss": losses}, f)


def trainer(out):
  workdir = os.path.abspath(os.path.join(out, "workdir"))
  run = lambda steps, into: subprocess.run(
      [sys.executable, "-m", "train", f"--workdir={into}", *TRAIN_ARGS,
       f"--config.num_train_steps={steps}"],
      check=True,
  )
  run(3, workdir)
  resumed = workdir + "-resumed"
  shutil.copytree(workdir, resumed)
  run(6, resumed)
  with open(os.path.join(resumed, "metrics.jsonl")) as f:
    lines = [json.loads(l) for l in f]
  losses = {l["step"]: l["loss"] for l in lines if "loss" in l}
  with open(os.path.join(out, "losses.json"), "w") as f:
    json.dump({"steps": [4, 5, 6], "loss": [losses[s] for s in (4, 5, 6)]}, f)
  shutil.rmtree(resumed)
  shutil.rmtree(os.path.join(workdir, "tensorboard"), ignore_errors=True)


def strip_paths(root):
  """Orbax's commit markers name the folder they were written in: a path of
  the machine that made them, not the repository's."""
  for marker in pathlib.Path(root).rglob("commit_success.txt"):
    marker.write_text("Checkpoint commit was successful.\n")


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  root = sys.argv[1]
  for name, make in (("library", library), ("trainer", trainer)):
    os.makedirs(os.path.join(root, name), exist_ok=True)
    make(os.path.join(root, name))
  strip_paths(root)
  with open(os.path.join(root, "release.json"), "w") as f:
    json.dump({"acp_jax": acp_jax.__version__, "jax": jax.__version__}, f)
