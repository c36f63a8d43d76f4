"""Checks a training config and builds the optimizer it names.

Everything here runs before any compilation, so a bad config fails in
milliseconds with the offending key and value in the message.
"""

import importlib.util
import math
import numbers
import os
from typing import Any

import ml_collections
import optax

import acp_jax
from train import pipeline

COMPRESSORS = {
    "ssgd": acp_jax.ssgd,
    "sign_sgd": acp_jax.sign_sgd,
    "topk_sgd": acp_jax.topk_sgd,
    "power_sgd": acp_jax.power_sgd,
    "acp_sgd": acp_jax.acp_sgd,
}

# Top-level keys the train loop reads; any other key is a typo.
KEYS = frozenset(
    {
        "seed",
        "num_train_steps",
        "batch_size",
        "per_device_batch_size",
        "log_every_steps",
        "eval_every_steps",
        "checkpoint_every_steps",
        "keep_checkpoints",
        "batch_norm",
        "nonfinite",
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

SCHEDULE_KEYS = {
    "constant": {"warmup_steps"},
    "cosine": {"warmup_steps", "end_factor"},
    "step": {"warmup_steps", "boundaries", "decay_factor"},
}
# What the compressor averages: the gradient, or (AdamW only) Adam's first
# moment, its second frozen after the compressor's dense warm-up, as it is
# or divided by sqrt(nu) + eps (``acp_jax.compressed_adam``'s
# ``preconditioned``), by name.
COMPRESS = {
    "gradient": None,
    "momentum": False,
    "preconditioned_momentum": True,
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


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(key: str, value, low: int, high: int | None = None) -> None:
  """Raises unless ``value`` is an int in ``[low, high]``."""
  if not _is_int(value) or value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{key} must be an int {bound}, got {value!r}")


def _check_number(
    key: str,
    value,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
  """Raises unless ``value`` is a finite real number in the interval from
  ``low`` to ``high``, each end open or closed."""
  ok = (
      isinstance(value, numbers.Real)
      and not isinstance(value, bool)
      and math.isfinite(value)
      and (value > low if low_open else value >= low)
      and (value < high if high_open or high == math.inf else value <= high)
  )
  if not ok:
    interval = (
        f"{'(' if low_open else '['}{low}, {high}"
        f"{')' if high_open or high == math.inf else ']'}"
    )
    raise ValueError(
        f"{key} must be a finite number in {interval}, got {value!r}"
    )


# The seed feeds jax.random.PRNGKey, which wraps values of 2**32 and more
# around to other keys, and NumPy's generators.
MAX_SEED = 2**32 - 1

# Ranges of the optimizer's and the schedule's numbers (the optimizer's
# shared ones and those of each optimizer's own dict), as ``_check_number``'s
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
    elif _is_int(value):
      _check_int(name, value, 1)
    elif isinstance(value, float) and "dropout" in key:
      _check_number(name, value, 0.0, 1.0, high_open=True)
    elif isinstance(value, float):
      _check_number(name, value, 0.0)


def _check_optimizer_numbers(section: str, args) -> None:
  for key, value in args.items():
    if key in OPTIMIZER_RANGES:
      _check_number(f"{section}.{key}", value, **OPTIMIZER_RANGES[key])
    elif key == "nesterov":
      _check_choice(f"{section}.nesterov", value, (False, True))


def _check_numbers(config: ml_collections.ConfigDict) -> None:
  """Signs and ranges of every number the trainer reads itself (the
  compressor's are its factory's to check, the loaders' their own)."""
  _check_int("config.seed", config.seed, 0, MAX_SEED)
  for key in ("num_train_steps", "log_every_steps"):
    _check_int(f"config.{key}", config[key], 1)
  for key in (
      "eval_every_steps",
      "checkpoint_every_steps",
      "keep_checkpoints",
      "per_device_batch_size",
      "batch_size",
  ):
    _check_int(f"config.{key}", config[key], 0)
  _check_optimizer_numbers("config.optimizer", config.optimizer)
  for name in OPTIMIZERS:
    _check_optimizer_numbers(
        f"config.optimizer.{name}", config.optimizer.get(name, {})
    )
  factor = config.get("divergence_factor")
  if factor:  # 0 and None turn the guard off
    _check_number("config.divergence_factor", factor, 1.0, low_open=True)
  schedule = config.schedule
  _check_int("config.schedule.warmup_steps", schedule.get("warmup_steps", 0), 0)
  for key, value in schedule.items():
    if key in SCHEDULE_RANGES:
      _check_number(f"config.schedule.{key}", value, **SCHEDULE_RANGES[key])
  if "boundaries" in schedule:
    boundaries = schedule.boundaries
    if not isinstance(boundaries, (list, tuple)):
      raise ValueError(
          "config.schedule.boundaries must be a list of fractions of the"
          f" steps after warmup, got {boundaries!r}"
      )
    for i, b in enumerate(boundaries):
      _check_number(f"config.schedule.boundaries[{i}]", b, 0.0, 1.0)
  _check_model_numbers("config.model", config.model)


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ``ValueError`` naming the first bad key and its value."""
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
  _check_choice("config.schedule.name", config.schedule.name, SCHEDULE_KEYS)
  _check_keys(
      "config.schedule",
      set(config.schedule) - {"name"},
      SCHEDULE_KEYS[config.schedule.name],
  )
  for section in ("model", "data"):
    if "name" not in config[section]:
      raise ValueError(f"config.{section}.name is missing")
  _check_numbers(config)
  global_batch_size(config, num_devices)
  pipeline.check(config.data_workers, config.data_prefetch)
  _check_choice("config.compressor.name", config.compressor.name, COMPRESSORS)
  _check_keys(
      "config.compressor",
      set(config.compressor) - {"name", "compress"},
      COMPRESSORS,
  )
  _check_choice("config.compressor.compress", _compress(config), COMPRESS)
  compress = _compress(config)
  if compress != "gradient" and config.optimizer.name != "adamw":
    raise ValueError(
        f"config.compressor.compress={compress!r} compresses AdamW's first"
        f" moment, but config.optimizer.name={config.optimizer.name!r}; set"
        " config.optimizer.name='adamw' or compress='gradient'"
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


def compressor(
    config: ml_collections.ConfigDict,
    axis_name: str,
    leaf_order: tuple[int, ...] | None = None,
) -> acp_jax.Compressor:
  """The compressor ``config.compressor.name``, called with the arguments in
  ``config.compressor[name]`` (each compressor has its own dict, so none is
  ever ignored); a bad argument names its key. ``leaf_order`` (the model's
  ``acp_jax.backward_order``) orders its buckets, unless the config sets one."""
  name = config.compressor.name
  args = dict(config.compressor.get(name, {}))
  if leaf_order is not None:
    args.setdefault("leaf_order", leaf_order)
  try:
    made = COMPRESSORS[name](axis_name=axis_name, **args)
  except TypeError as e:  # an argument the factory does not take
    raise ValueError(f"config.compressor.{name}: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.compressor.{name}: {e}") from None
  compress = _compress(config)
  if compress == "gradient":
    return made
  try:
    return acp_jax.compressed_adam(
        made, **_adam_moments(config), preconditioned=COMPRESS[compress]
    )
  except TypeError as e:  # an argument of AdamW's that it does not take
    raise ValueError(f"config.optimizer.adamw: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.compressor.compress={compress!r}: {e}") from None


def _compress(config: ml_collections.ConfigDict) -> str:
  return config.compressor.get("compress", "gradient")


def _adam_moments(config: ml_collections.ConfigDict) -> dict[str, float]:
  """AdamW's own arguments (its decays and eps), for compressed_adam."""
  return dict(config.optimizer.get("adamw", {}))


def schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0, then ``config.schedule.name``'s decay."""
  args = config.schedule
  peak = config.optimizer.learning_rate
  warmup = args.get("warmup_steps", 0)
  steps = max(config.num_train_steps - warmup, 1)
  if args.name == "constant":
    after = optax.constant_schedule(peak)
  elif args.name == "cosine":
    after = optax.cosine_decay_schedule(
        peak, steps, alpha=args.get("end_factor", 0.0)
    )
  else:
    after = optax.piecewise_constant_schedule(
        peak,
        {
            int(b * steps): args.get("decay_factor", 0.1)
            for b in args.get("boundaries", (0.5, 0.75))
        },
    )
  if not warmup:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup), after], [warmup]
  )


def _sgd(learning_rate, weight_decay, *, momentum=0.0, nesterov=False):
  # Weight decay added to the gradient, so momentum carries it (L2, as
  # PyTorch's SGD does); no momentum keeps no trace in the state.
  return optax.chain(
      optax.add_decayed_weights(weight_decay),
      optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov),
  )


def _adamw(learning_rate, weight_decay, *, b1=0.9, b2=0.999, eps=1e-8):
  # Decoupled weight decay, scaled by the learning rate (optax's AdamW).
  return optax.adamw(
      learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay
  )


# The base optimizers by name: each takes the shared arguments
# (``OPTIMIZER_SHARED``) and, as keywords, its own dict of the config.
OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}
OPTIMIZER_SHARED = ("learning_rate", "weight_decay")


def optimizer(
    config: ml_collections.ConfigDict, lr: optax.ScalarOrSchedule
) -> optax.GradientTransformation:
  """The base optimizer that follows the compressor in the chain.

  ``config.optimizer.name`` is called with the learning rate ``lr`` (the
  schedule), ``config.optimizer.weight_decay`` and the arguments in
  ``config.optimizer[name]``: each optimizer has its own dict, so switching
  ``name`` never meets another optimizer's arguments, and one the factory
  does not take is refused naming its key.
  """
  args = config.optimizer
  name = args.name
  if _compress(config) != "gradient":
    # Adam's scaling is the compressor's (compressed_adam, which takes
    # AdamW's own arguments); what follows it in optax.adamw follows here.
    return optax.chain(
        optax.add_decayed_weights(args.get("weight_decay", 0.0)),
        optax.scale_by_learning_rate(lr),
    )
  try:
    return OPTIMIZERS[name](
        lr, args.get("weight_decay", 0.0), **dict(args.get(name, {}))
    )
  except TypeError as e:  # an argument the factory does not take
    raise ValueError(f"config.optimizer.{name}: {e}") from None


def kwargs(section: ml_collections.ConfigDict) -> dict[str, Any]:
  """A ``name``-plus-arguments section's arguments, as plain Python values."""
  args = section.to_dict()
  args.pop("name")
  return args
