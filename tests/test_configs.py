"""Every config builds; the small ones train a few steps end to end."""

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

from train import models
from train import experiment as experiment_lib
from train import train

SHARED = "../shared/data"
PAPER = {
    # config: (parameters, override to synthetic data)
    "resnet50_imagenet": (25_557_032, "synthetic_images"),
    "resnet152_imagenet": (60_192_808, "synthetic_images"),
    "bert_base": (109_514_298, None),
    "bert_large": (335_174_458, None),
    "cifar10_resnet18": (11_173_962, "synthetic_images"),
}


def get_config(name):
  return importlib.import_module(f"configs.{name}").get_config()


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_build_on_synthetic_data(name):
  """One override makes each runnable with no data set (shapes only)."""
  params, synthetic = PAPER[name]
  config = get_config(name)
  if synthetic:
    config.data.name = synthetic
  experiment = experiment_lib.build(config)
  assert models.num_params(experiment.abstract_params) == params
  assert experiment.global_batch == (
      config.per_device_batch_size * experiment.num_devices or config.batch_size
  )


def test_real_data_configs_name_their_missing_data():
  with pytest.raises(FileNotFoundError, match="config.data.data_dir"):
    experiment_lib.build(get_config("cifar10_resnet18"))


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("mnist", {"data.path": f"{SHARED}/mnist-t10k"}),
        (
            "tinyshakespeare",
            {
                "data.path": f"{SHARED}/tinyshakespeare/input.txt",
                "data.seq_len": 32,
                "model.max_len": 32,
                "model.dim": 32,
                "model.num_layers": 1,
            },
        ),
        (
            "bert_base",
            {
                "data.seq_len": 16,
                "data.vocab_size": 512,
                "model": {
                    "name": "bert",
                    "size": {
                        "num_layers": 1,
                        "hidden": 32,
                        "heads": 2,
                        "ffn": 64,
                    },
                    "max_len": 16,
                },
                "compressor.acp_sgd.rank": 4,
                "per_device_batch_size": 2,
            },
        ),
        (
            "bert_shakespeare",
            {
                "data.path": f"{SHARED}/tinyshakespeare/input.txt",
                "data.seq_len": 16,
                "data.vocab_size": 256,
                "model.size": {
                    "num_layers": 1,
                    "hidden": 32,
                    "heads": 2,
                    "ffn": 64,
                },
                "model.max_len": 16,
            },
        ),
    ],
)
def test_small_configs_train(name, overrides, tmp_path):
  """Three steps of each task (classification, causal LM, masked LM)."""
  config = get_config(name)
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (config[section] if section else config)[field] = value
  if name != "bert_base":
    config.batch_size = 32
  config.num_train_steps = 3
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.schedule.warmup_steps = 1
  if "path" in config.data and not os.path.exists(config.data.path):
    pytest.skip(f"{config.data.path} is not here")
  if "tokenizer" in config.data:  # trained here, not beside the shared text
    config.data.tokenizer = str(tmp_path / "tokenizer.json")
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["step"] == 3
  assert np.isfinite(summary["loss"]) and np.isfinite(summary["eval_loss"])


def test_nan_loss_stops_with_a_clear_error(tmp_path):
  config = get_config("default")
  config.optimizer.learning_rate = 1e30
  config.num_train_steps = 5
  config.model.width = 8
  config.compressor.name = "ssgd"
  with pytest.raises(FloatingPointError, match="is not finite at step"):
    train.train_and_evaluate(config, str(tmp_path))


def test_command_line_names_an_unknown_override(tmp_path):
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "train",
          "--config=configs/default.py",
          f"--workdir={tmp_path}",
          "--config.compressor.acp_sgd.rnk=8",
      ],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode != 0
  assert "unknown config key in --config.compressor.acp_sgd.rnk=8" in result.stderr
  assert 'Did you mean "rank"' in result.stderr


def test_the_trainer_buckets_gradients_in_backward_order():
  # The default model's output layer, "fc", is its first leaf: the reverse
  # of the leaf order would send its gradients last, backprop makes them
  # first.
  import jax  # pylint: disable=g-import-not-at-top

  experiment = experiment_lib.build(get_config("default"))
  paths = [
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_leaves_with_path(
          experiment.abstract_params
      )
  ]
  order = experiment.compressor.leaf_order
  assert sorted(order) == list(range(len(paths)))
  assert {paths[i] for i in order[:2]} == {"['fc']['bias']", "['fc']['kernel']"}
  first_bucket = experiment.compressor.buckets(experiment.abstract_params)[0]
  assert first_bucket[:2] == order[:2]
