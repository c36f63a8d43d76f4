"""Checks a training config and builds the optimizer it names.

Everything here runs before any compilation, so a bad config fails in
milliseconds with the offending key and value in the message.
"""

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

OPTIMIZER_KEYS = {
    "sgd": {"learning_rate", "momentum", "nesterov", "weight_decay"},
    "adamw": {"learning_rate", "b1", "b2", "eps", "weight_decay"},
}
SCHEDULE_KEYS = {
    "constant": {"warmup_steps"},
    "cosine": {"warmup_steps", "end_factor"},
    "step": {"warmup_steps", "boundaries", "decay_factor"},
}
BATCH_NORM = ("local", "sync")
NONFINITE = ("stop", "skip")


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


def _positive_int(key: str, value, *, zero_ok: bool = False) -> None:
  if (
      not isinstance(value, int)
      or isinstance(value, bool)
      or value < (0 if zero_ok else 1)
  ):
    kind = "a non-negative" if zero_ok else "a positive"
    raise ValueError(f"{key} must be {kind} int, got {value!r}")


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ``ValueError`` naming the first bad key and its value."""
  _check_keys("config", config.keys(), KEYS)
  _check_choice("config.batch_norm", config.batch_norm, BATCH_NORM)
  _check_choice("config.nonfinite", config.nonfinite, NONFINITE)
  for key in ("num_train_steps", "log_every_steps"):
    _positive_int(f"config.{key}", config[key])
  for key in (
      "eval_every_steps",
      "checkpoint_every_steps",
      "keep_checkpoints",
      "per_device_batch_size",
      "batch_size",
  ):
    _positive_int(f"config.{key}", config[key], zero_ok=True)
  global_batch_size(config, num_devices)
  pipeline.check(config.data_workers, config.data_prefetch)

  _check_choice("config.compressor.name", config.compressor.name, COMPRESSORS)
  _check_keys("config.compressor", set(config.compressor) - {"name"}, COMPRESSORS)
  compressor(config, "data")  # the factory checks its own arguments
  _check_choice("config.optimizer.name", config.optimizer.name, OPTIMIZER_KEYS)
  _check_keys(
      "config.optimizer",
      set(config.optimizer) - {"name"},
      OPTIMIZER_KEYS[config.optimizer.name],
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
    return COMPRESSORS[name](axis_name=axis_name, **args)
  except TypeError as e:  # an argument the factory does not take
    raise ValueError(f"config.compressor.{name}: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.compressor.{name}: {e}") from None


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


def optimizer(
    config: ml_collections.ConfigDict, lr: optax.Schedule
) -> optax.GradientTransformation:
  """The base optimizer that follows the compressor in the chain."""
  args = config.optimizer
  decay = args.get("weight_decay", 0.0)
  if args.name == "sgd":
    return optax.chain(
        optax.add_decayed_weights(decay),
        optax.sgd(
            lr,
            momentum=args.get("momentum", 0.0) or None,
            nesterov=args.get("nesterov", False),
        ),
    )
  return optax.adamw(
      lr,
      b1=args.get("b1", 0.9),
      b2=args.get("b2", 0.999),
      eps=args.get("eps", 1e-8),
      weight_decay=decay,
  )


def kwargs(section: ml_collections.ConfigDict) -> dict[str, Any]:
  """A ``name``-plus-arguments section's arguments, as plain Python values."""
  args = section.to_dict()
  args.pop("name")
  return args
