"""Checks a training config: its keys, its choices and its numbers.

The optimizer, the schedule and the compressor it names are built in
``train.optimizers``; ``validate`` builds them once, so that their factories
check their own arguments.

Everything here runs before any compilation, so a bad config fails in
milliseconds with the offending key and value in the message.
"""

import importlib.util
import os
from typing import Any

import ml_collections

from acp_jax import registry

from train import checks
from train import models
from train import pipeline
from train.optimizers import compressor
from train.optimizers import optimizer
from train.optimizers import OPTIMIZER_SHARED
from train.optimizers import OPTIMIZERS

# Top-level keys the train loop reads; any other key is a typo.
KEYS = frozenset(
    {
        "seed",
        "num_train_steps",
        "batch_size",
        "per_device_batch_size",
        "log_every_steps",
        "eval_every_steps",
        "target_eval_loss",
        "checkpoint_every_steps",
        "keep_checkpoints",
        "batch_norm",
        "nonfinite",
        "max_skipped_fraction",
        "divergence_factor",
        "augment",
        "data_workers",
        "data_prefetch",
        "model",
        "data",
        "compressor",
        "optimizer",
        "schedule",
    }
)

# Each schedule's own arguments, in a dict of its own beside the name and
# the warmup, so that switching config.schedule.name never meets another's.
SCHEDULES = {
    "constant": (),
    "cosine": ("end_factor",),
    "step": ("boundaries", "decay_factor"),
}
BATCH_NORM = ("local", "sync")
NONFINITE_POLICIES = ("stop", "skip")


def _check_keys(section: str, keys, allowed) -> None:
  unknown = sorted(set(keys) - set(allowed))
  if unknown:
    raise ValueError(
        f"unknown config key(s) {', '.join(f'{section}.{k}' for k in unknown)}"
        f"; known: {', '.join(sorted(allowed))}"
    )


def _check_choice(key: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")


# The seed feeds jax.random.PRNGKey, which wraps values of 2**32 and more
# around to other keys, and NumPy's generators.
MAX_SEED = 2**32 - 1

# Ranges of the optimizer's and the schedule's numbers (the optimizer's
# shared ones and those of each optimizer's own dict), as ``checks.number``'s
# arguments after the key and value.
OPTIMIZER_RANGES = {
    "learning_rate": dict(low=0.0, low_open=True),
    "momentum": dict(low=0.0, high=1.0, high_open=True),
    "weight_decay": dict(low=0.0),
    "b1": dict(low=0.0, high=1.0, high_open=True),
    "b2": dict(low=0.0, high=1.0, high_open=True),
    "eps": dict(low=0.0, low_open=True),
}
SCHEDULE_RANGES = {
    "end_factor": dict(low=0.0, high=1.0),
    "decay_factor": dict(low=0.0, high=1.0, low_open=True),
}


def _check_model_numbers(section: str, args) -> None:
  """Sizes (every int) must be positive, rates (every float) finite and
  non-negative, dropout below 1; nested sections are checked alike."""
  for key, value in args.items():
    name = f"{section}.{key}"
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      _check_model_numbers(name, value)
    elif checks.is_int(value):
      checks.int_in(name, value, 1)
    elif isinstance(value, float) and "dropout" in key:
      checks.number(name, value, 0.0, 1.0, high_open=True)
    elif isinstance(value, float):
      checks.number(name, value, 0.0)


def _check_optimizer_numbers(section: str, args) -> None:
  for key, value in args.items():
    if key in OPTIMIZER_RANGES:
      checks.number(f"{section}.{key}", value, **OPTIMIZER_RANGES[key])
    elif key == "nesterov":
      _check_choice(f"{section}.nesterov", value, (False, True))


def _check_numbers(config: ml_collections.ConfigDict) -> None:
  """Signs and ranges of every number the trainer reads itself (the
  compressor's are its factory's to check, the loaders' their own)."""
  checks.int_in("config.seed", config.seed, 0, MAX_SEED)
  for key in ("num_train_steps", "log_every_steps"):
    checks.int_in(f"config.{key}", config[key], 1)
  for key in (
      "eval_every_steps",
      "checkpoint_every_steps",
      "keep_checkpoints",
      "per_device_batch_size",
      "batch_size",
  ):
    checks.int_in(f"config.{key}", config[key], 0)
  _check_optimizer_numbers("config.optimizer", config.optimizer)
  for name in OPTIMIZERS:
    _check_optimizer_numbers(
        f"config.optimizer.{name}", config.optimizer.get(name, {})
    )
  if config.get("target_eval_loss") is not None:
    checks.number(
        "config.target_eval_loss", config.target_eval_loss, 0.0, low_open=True
    )
  checks.number(
      "config.max_skipped_fraction", config.max_skipped_fraction, 0.0, 1.0
  )
  factor = config.get("divergence_factor")
  if factor:  # 0 and None turn the guard off
    checks.number("config.divergence_factor", factor, 1.0, low_open=True)
  checks.int_in(
      "config.schedule.warmup_steps", config.schedule.get("warmup_steps", 0), 0
  )
  for name in SCHEDULES:
    _check_schedule_numbers(
        f"config.schedule.{name}", config.schedule.get(name, {})
    )
  _check_model_numbers("config.model", config.model)


def _check_schedule_numbers(section: str, args) -> None:
  for key, value in args.items():
    if key in SCHEDULE_RANGES:
      checks.number(f"{section}.{key}", value, **SCHEDULE_RANGES[key])
  if "boundaries" in args:
    boundaries = args["boundaries"]
    if not isinstance(boundaries, (list, tuple)):
      raise ValueError(
          f"{section}.boundaries must be a list of fractions of the"
          f" steps after warmup, got {boundaries!r}"
      )
    for i, b in enumerate(boundaries):
      checks.number(f"{section}.boundaries[{i}]", b, 0.0, 1.0)


def _check_schedule_keys(schedule) -> None:
  """The schedule's keys: its name, the warmup and each schedule's dict;
  an argument of one beside the name is pointed to that dict."""
  for key in set(schedule) - {"name", "warmup_steps", *SCHEDULES}:
    owner = next((n for n, args in SCHEDULES.items() if key in args), None)
    if owner is not None:
      raise ValueError(
          f"config.schedule.{key} belongs in the {owner} schedule's own"
          f" dict: set config.schedule.{owner}.{key} (each schedule takes"
          " its arguments in a dict of its own beside"
          f" config.schedule.name: {_schedule_args()})"
      )
  _check_keys(
      "config.schedule",
      set(schedule) - {"name"},
      {"warmup_steps", *SCHEDULES},
  )
  for name, allowed in SCHEDULES.items():
    _check_keys(f"config.schedule.{name}", schedule.get(name, {}), allowed)


def _schedule_args() -> str:
  """Which arguments each schedule takes, for a message."""
  return "; ".join(
      f"{name}: {', '.join(args) or 'none'}" for name, args in SCHEDULES.items()
  )


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ``checks.ConfigError`` (a ``ValueError``) naming the first bad
  key and its value."""
  try:
    _validate(config, num_devices)
  except checks.ConfigError:
    raise
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None


def _validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError(
        "the config must be an ml_collections.ConfigDict, got"
        f" {type(config).__name__}"
    )
  _check_keys("config", config.keys(), KEYS)
  _check_choice("config.batch_norm", config.batch_norm, BATCH_NORM)
  _check_choice("config.nonfinite", config.nonfinite, NONFINITE_POLICIES)
  _check_choice("config.optimizer.name", config.optimizer.name, OPTIMIZERS)
  _check_keys(
      "config.optimizer",
      set(config.optimizer) - {"name"},
      {*OPTIMIZER_SHARED, *OPTIMIZERS},
  )
  _check_choice("config.schedule.name", config.schedule.name, SCHEDULES)
  _check_schedule_keys(config.schedule)
  for section in ("model", "data"):
    if "name" not in config[section]:
      raise ValueError(f"config.{section}.name is missing")
  _check_choice("config.model.name", config.model.name, sorted(models.MODELS))
  _check_numbers(config)
  global_batch_size(config, num_devices)
  pipeline.check(config.data_workers, config.data_prefetch)
  _check_choice(
      "config.compressor.name", config.compressor.name, registry.names()
  )
  _check_keys(
      "config.compressor",
      set(config.compressor) - {"name", "auto"},
      registry.names(),
  )
  compressor(config, "data")  # the factory checks its own arguments
  optimizer(config, config.optimizer.learning_rate)  # and so does this one


def load_file(path: str) -> ml_collections.ConfigDict:
  """The config that ``get_config()`` of the file at ``path`` returns.

  ``path`` may end in ``:ARG``, passed to ``get_config`` as
  ``ml_collections.config_flags`` does.

  Raises:
    ValueError: naming ``path``, if it is not a Python file with a
      ``get_config()`` that returns an ``ml_collections.ConfigDict``.
  """
  file, *args = path.split(":", 1)
  if not os.path.isfile(file):
    raise ValueError(f"the config file {file} does not exist")
  spec = importlib.util.spec_from_file_location("config_file", file)
  if spec is None:  # not a .py file: nothing would load it
    raise ValueError(
        f"the config file {file} is not a Python file: a config is a .py"
        " file defining get_config() that returns an"
        " ml_collections.ConfigDict (configs/default.py is one); write its"
        " settings there, or override them with --config.KEY=VALUE"
    )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ValueError(
        f"the config file {file} defines no get_config(); a config file"
        " defines get_config() returning an ml_collections.ConfigDict"
    )
  config = get_config(*args)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(
        f"get_config() of the config file {file} returned a"
        f" {type(config).__name__}; it must return an"
        " ml_collections.ConfigDict"
    )
  return config


def global_batch_size(config: ml_collections.ConfigDict, num_devices: int):
  """The global batch: ``per_device_batch_size`` x devices, or ``batch_size``."""
  per_device, total = config.per_device_batch_size, config.batch_size
  if bool(per_device) == bool(total):
    raise ValueError(
        "set exactly one of config.batch_size (global) and"
        " config.per_device_batch_size, got"
        f" batch_size={total!r}, per_device_batch_size={per_device!r}"
    )
  if per_device:
    return per_device * num_devices
  if total % num_devices:
    raise ValueError(
        f"config.batch_size={total} is not divisible by the {num_devices}"
        " devices"
    )
  return total


def kwargs(section: ml_collections.ConfigDict) -> dict[str, Any]:
  """A ``name``-plus-arguments section's arguments, as plain Python values."""
  args = section.to_dict()
  args.pop("name")
  return args
