"""Every config builds; the small ones train a few steps end to end."""

import dataclasses
import importlib
import inspect
import json
import os
import re

import numpy as np
import optax
import pytest

import acp_jax

from acp_jax import registry
from configs import default
from tests import datafiles
from tests import helpers
from train import config as config_lib
from train import models
from train import optimizers
from train import experiment as experiment_lib
from train import train


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
    "name, where",
    [
        ("mnist", "MNIST's IDX files"),
        ("tinyshakespeare", "tinyshakespeare/input.txt"),
        ("bert_shakespeare", "tinyshakespeare/input.txt"),
    ],
)
def test_configs_of_unbundled_data_say_where_to_get_it(name, where):
  with pytest.raises(ValueError, match="needs config.data.path: ") as error:
    experiment_lib.build(get_config(name))
  assert where in str(error.value) and "https://" in str(error.value)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
  """Small files in the formats of the data sets the configs name."""
  root = tmp_path_factory.mktemp("data")
  datafiles.write_mnist(root / "mnist", 300)
  datafiles.write_text(root / "play.txt", 3000)
  return {
      "mnist": str(root / "mnist"),
      "text": str(root / "play.txt"),
      "masked_text": str(root / "play.txt"),
  }


# (config, overrides) small enough to train a few steps here.
SMALL_CONFIGS = [
    ("mnist", {"data.eval_examples": 100}),
    (
        "tinyshakespeare",
        {
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
]


# The embedded MNIST config trains in the quick tier; the text and BERT
# configs, slower to compile, in the slow one.
@pytest.mark.parametrize(
    "name, overrides",
    [
        pytest.param(n, o, marks=[] if n == "mnist" else [pytest.mark.slow])
        for n, o in SMALL_CONFIGS
    ],
)
def test_small_configs_train(name, overrides, data_files, tmp_path):
  """Three steps of each task (classification, causal LM, masked LM)."""
  config = get_config(name)
  if "path" in config.data:
    config.data.path = data_files[config.data.name]
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (config[section] if section else config)[field] = value
  if name != "bert_base":
    config.batch_size = 32
  config.num_train_steps = 3
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.schedule.warmup_steps = 1
  default.dense_warmup(config)  # one dense step, two compressed
  if "tokenizer" in config.data:  # trained here, not beside the text
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
  result = helpers.run_module(
      "train",
      "--config=configs/default.py",
      f"--workdir={tmp_path}",
      "--config.compressor.acp_sgd.rnk=8",
      timeout=120,
  )
  assert result.returncode != 0
  assert (
      "unknown config key in --config.compressor.acp_sgd.rnk=8" in result.stderr
  )
  assert 'Did you mean "rank"' in result.stderr


# Command lines refused in one line: flags out of range, a workdir that is a
# file ({file}), the auto compressor without its link or with a bad number.
AUTO = "--config.compressor.name=auto"
ONE_LINE = [
    (
        ["--distributed_timeout_s=0"],
        "--distributed_timeout_s must be an int >= 1, got 0",
    ),
    (
        ["--distributed_timeout_s=-5"],
        "--distributed_timeout_s must be an int >= 1, got -5",
    ),
    (["--lapack_threads=-1"], "--lapack_threads must be an int >= 0, got -1"),
    (["--num_cpu_devices=0"], "--num_cpu_devices must be an int >= 1, got 0"),
    (
        [
            "--coordinator_address=127.0.0.1:1",
            "--num_processes=2",
            "--process_id=2",
        ],
        "--process_id must be an int in [0, 1], got 2",
    ),
    (
        ["--workdir={file}"],
        "the workdir {file} is an existing file, not a directory",
    ),
    (
        [AUTO],
        "config.compressor.name='auto' needs config.compressor.auto.bandwidth",
    ),
    (
        [AUTO, "--config.compressor.auto.bandwidth=-1"],
        "config.compressor.auto.bandwidth must be a number of bytes per second",
    ),
    (
        [
            AUTO,
            "--config.compressor.auto.bandwidth=1e9",
            "--config.compressor.auto.steps=1",
        ],
        "config.compressor.auto.steps must be an int >= 3, got 1",
    ),
    (
        [
            AUTO,
            "--config.compressor.auto.bandwidth=1e9",
            "--config.compressor.auto.run_steps=3",
        ],
        "config.compressor.auto.run_steps must be 0 (no short run) or an int"
        " >= 8, got 3",
    ),
]


@pytest.mark.parametrize("args, message", ONE_LINE)
def test_command_line_refusals_are_one_line(args, message, tmp_path):
  """Each is refused before training, in one line naming the flag or key
  and the value: no traceback, no process left waiting on its peers."""
  file = tmp_path / "a_file"
  file.write_text("")
  args = [a.format(file=file) for a in args]
  if not any(a.startswith("--num_cpu_devices") for a in args):
    args.append("--num_cpu_devices=2")
  if not any(a.startswith("--workdir") for a in args):
    args.append(f"--workdir={tmp_path / 'run'}")
  result = helpers.run_module(
      "train", "--config=configs/default.py", *args, timeout=300
  )
  assert result.returncode != 0
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(message.format(file=file)), result.stderr[-3000:]


# A number of the default config out of its range, and the range named.
OUT_OF_RANGE = [
    ("schedule.warmup_steps", -5, "an int >= 0"),
    ("optimizer.learning_rate", -0.1, "a finite number in (0.0, inf)"),
    ("optimizer.learning_rate", float("nan"), "a finite number in (0.0, inf)"),
    ("optimizer.learning_rate", float("inf"), "a finite number in (0.0, inf)"),
    ("optimizer.sgd.momentum", 1.5, "a finite number in [0.0, 1.0)"),
    ("optimizer.adamw.b2", 1.0, "a finite number in [0.0, 1.0)"),
    ("optimizer.weight_decay", -1e-4, "a finite number in [0.0, inf)"),
    ("divergence_factor", 0.5, "a finite number in (1.0, inf)"),
    ("schedule.cosine.end_factor", -1.0, "a finite number in [0.0, 1.0]"),
    ("model.width", 0, "an int >= 1"),
    ("seed", 10**20, "an int in [0, 4294967295]"),
    ("seed", -1, "an int in [0, 4294967295]"),
    ("batch_size", -128, "an int >= 0"),
    ("checkpoint_every_steps", -1, "an int >= 0"),
]


@pytest.mark.parametrize("key, value, bound", OUT_OF_RANGE)
def test_numbers_out_of_range_are_refused_naming_the_key(
    key, value, bound, monkeypatch, tmp_path
):
  config = get_config("default")
  section, _, field = key.rpartition(".")
  (config[section] if section else config)[field] = value

  def compiled(*args, **kwargs):
    raise AssertionError("compiled before checking the config")

  monkeypatch.setattr(train, "compile_steps", compiled)
  message = f"config.{key} must be {bound}, got {value!r}"
  with pytest.raises(ValueError, match=re.escape(message)):
    train.train_and_evaluate(config, str(tmp_path))


def test_the_default_config_holds_every_compressor_argument():
  """So that each can be set from the command line (keep_dense is a tree or
  a function of the params, which no flag can hold; the trainer reads
  leaf_order from the model's loss)."""
  config = get_config("default")
  for name in registry.names():
    parameters = inspect.signature(registry.get(name).factory).parameters
    arguments = {
        k for k, p in parameters.items() if p.kind is not p.VAR_KEYWORD
    }
    if "options" in arguments:  # the low-rank ones: their LowRankOptions
      arguments.remove("options")
      arguments |= {f.name for f in dataclasses.fields(acp_jax.LowRankOptions)}
    assert arguments - {"axis_name", "keep_dense", "leaf_order"} == set(
        config.compressor[name]
    ), name


def _command(tmp_path, *args):
  return helpers.run_module(
      "train", f"--workdir={tmp_path / 'run'}", *args, timeout=300
  )


@pytest.mark.slow
def test_compressor_arguments_are_set_from_the_command_line(tmp_path):
  overrides = [
      "--config.compressor.acp_sgd.comm_dtype=bfloat16",
      "--config.compressor.acp_sgd.bucket_bytes=4096",
  ]
  result = _command(
      tmp_path,
      "--config=configs/default.py",
      "--num_cpu_devices=2",
      "--config.num_train_steps=2",
      "--config.batch_size=32",
      "--config.model.width=8",
      "--config.eval_every_steps=0",
      "--config.compressor.acp_sgd.warmup_steps=0",
      *overrides,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    sent = [l["bytes_sent"] for l in map(json.loads, f) if "loss" in l]
  config = get_config("default")
  config.model.width = 8
  config.compressor.acp_sgd.comm_dtype = "bfloat16"
  bf16 = experiment_lib.build(config).bytes_per_phase()
  assert sent == [bf16["p"], bf16["q"]]
  config.compressor.acp_sgd.comm_dtype = None
  assert bf16["p"] < experiment_lib.build(config).bytes_per_phase()["p"]
  # A bad bucket size reaches the factory that checks it.
  result = _command(
      tmp_path,
      "--config=configs/default.py",
      "--config.compressor.name=ssgd",
      "--config.compressor.ssgd.bucket_bytes=-1",
  )
  assert result.returncode != 0
  assert "config.compressor.ssgd: ssgd: bucket_bytes must be" in result.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("def other():\n  return 1\n", "defines no get_config()"),
        (
            "def get_config():\n  return {'seed': 0}\n",
            "returned a dict; it must return an ml_collections.ConfigDict",
        ),
    ],
)
def test_a_config_file_of_another_kind_is_refused_naming_it(
    text, message, tmp_path
):
  path = tmp_path / "my_config.py"
  path.write_text(text)
  result = _command(tmp_path, f"--config={path}")
  assert result.returncode != 0
  assert f"{path}" in result.stderr and message in result.stderr


def test_a_yaml_config_file_is_refused_saying_configs_are_python(tmp_path):
  path = tmp_path / "my_config.yaml"
  path.write_text("batch_size: 128\noptimizer:\n  learning_rate: 0.1\n")
  with pytest.raises(ValueError) as error:
    config_lib.load_file(str(path))
  first = str(error.value).splitlines()[0]
  assert f"the config file {path} is not a Python file" in first
  assert "defining get_config()" in first


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


CONFIGS = sorted(
    name[:-3]
    for name in os.listdir(os.path.join(helpers.ROOT, "configs"))
    if name.endswith(".py") and name != "__init__.py"
)


def _flags_config(*argv):
  """The config as ``python -m train`` parses ``--config`` and overrides."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  values, argv = flags.FlagValues(), ["train", *argv]
  config_flags.DEFINE_config_file(
      "config", None, "", flag_values=values, sys_argv=argv
  )
  values(argv)
  return values.config


def _sgd(optimizer):
  return optax.chain(
      optax.add_decayed_weights(optimizer.weight_decay),
      optax.sgd(0.1, momentum=0.5, nesterov=True),
  )


def _adamw(optimizer):
  adamw = optimizer.adamw
  return optax.adamw(
      0.1,
      b1=adamw.b1,
      b2=0.95,
      eps=adamw.eps,
      weight_decay=optimizer.weight_decay,
  )


@pytest.mark.parametrize(
    "chosen, overrides, expected, other",
    [
        ("sgd", ["sgd.momentum=0.5", "sgd.nesterov=True"], _sgd, "adamw"),
        ("adamw", ["adamw.b2=0.95"], _adamw, "sgd"),
    ],
)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_optimizer_is_chosen_by_name_on_every_config(
    name, chosen, overrides, expected, other
):
  """Switching the optimizer from the command line builds exactly optax's
  optimizer with the shared and that optimizer's own arguments; the other
  optimizer's arguments stay as they were."""
  config = _flags_config(
      f"--config={os.path.join(helpers.ROOT, 'configs', f'{name}.py')}",
      f"--config.optimizer.name={chosen}",
      *(f"--config.optimizer.{o}" for o in overrides),
  )
  config_lib.validate(config, 8)
  as_defined = get_config(name).optimizer[other]
  assert dict(config.optimizer[other]) == dict(as_defined)
  params = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)}
  grads = {"w": np.full((2, 3), 0.5, np.float32)}
  steps = [
      tx.update(grads, tx.init(params), params)[0]["w"]
      for tx in (optimizers.optimizer(config, 0.1), expected(config.optimizer))
  ]
  np.testing.assert_array_equal(*steps)


def test_an_argument_of_another_optimizer_is_refused_naming_it():
  config = get_config("default")
  config.optimizer.sgd.b1 = 0.9
  with pytest.raises(
      ValueError,
      match="config.optimizer.sgd: .*unexpected keyword argument 'b1'",
  ):
    config_lib.validate(config, 8)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_schedule_is_chosen_by_name_on_every_config(name):
  """``--config.schedule.name`` alone switches the schedule: each takes its
  arguments from a dict of its own, never meeting another's."""
  path = os.path.join(helpers.ROOT, "configs", f"{name}.py")
  for schedule in ("constant", "cosine", "step"):
    config = _flags_config(
        f"--config={path}", f"--config.schedule.name={schedule}"
    )
    config_lib.validate(config, 8)
    peak = config.optimizer.learning_rate
    after = config.schedule.warmup_steps + 1
    assert float(optimizers.schedule(config)(after)) == pytest.approx(
        peak, rel=1e-2
    )
    if schedule == "constant":
      last = config.num_train_steps - 1
      assert float(optimizers.schedule(config)(last)) == pytest.approx(peak)


def test_a_schedule_argument_beside_the_name_is_pointed_to_its_dict():
  config = get_config("default")
  config.schedule.end_factor = 0.1
  with pytest.raises(ValueError) as error:
    config_lib.validate(config, 8)
  first = str(error.value).splitlines()[0]
  assert "config.schedule.end_factor" in first
  assert "set config.schedule.cosine.end_factor" in first
  assert "step: boundaries, decay_factor" in first


def test_an_unknown_model_is_refused_listing_the_known_ones():
  config = get_config("default")
  config.model.name = "small-cnn"
  with pytest.raises(ValueError) as error:
    experiment_lib.build(config)
  first = str(error.value).splitlines()[0]
  assert "config.model.name must be one of" in first
  assert "'small_cnn'" in first and "'resnet50'" in first
  assert "got 'small-cnn'" in first
