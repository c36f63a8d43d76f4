"""The optimizer, its schedule and the compressor a training config names.

Each is chosen by name, with its own dict of arguments in the config, so an
argument of another choice is never met and one the factory does not take is
refused naming its key.
"""

import ml_collections
import optax

import acp_jax
from acp_jax import registry


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
    return registry.get(name).factory(axis_name=axis_name, **args)
  except TypeError as e:  # an argument the factory does not take
    raise ValueError(f"config.compressor.{name}: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.compressor.{name}: {e}") from None


def schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0, then ``config.schedule.name``'s decay, with the
  arguments in its own dict, ``config.schedule[name]``."""
  name = config.schedule.name
  args = config.schedule.get(name, {})
  peak = config.optimizer.learning_rate
  warmup = config.schedule.get("warmup_steps", 0)
  steps = max(config.num_train_steps - warmup, 1)
  if name == "constant":
    after = optax.constant_schedule(peak)
  elif name == "cosine":
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
  try:
    return OPTIMIZERS[name](
        lr, args.get("weight_decay", 0.0), **dict(args.get(name, {}))
    )
  except TypeError as e:  # an argument the factory does not take
    raise ValueError(f"config.optimizer.{name}: {e}") from None
