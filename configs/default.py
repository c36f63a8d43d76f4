"""The embedded default: digits on a small CNN with ACP-SGD.

Needs no download (scikit-learn's bundled 8x8 digits). Every other config
starts from this one and overrides what differs.
"""

import ml_collections
from ml_collections import config_dict

from acp_jax import registry


def _compressor_args(name: str) -> dict:
  """Compressor ``name``'s factory arguments (``acp_jax.registry``), a fresh
  dict for each, so that setting one leaves the others as they are; None
  stands for the factory's default, typed so that an override parses (e.g.
  --config.compressor.ssgd.comm_dtype=bfloat16)."""
  return {
      key: config_dict.placeholder(value) if isinstance(value, type) else value
      for key, value in registry.get(name).config.items()
  }


def dense_warmup(config: ml_collections.ConfigDict) -> None:
  """Gives Power-SGD and ACP-SGD dense S-SGD steps before they compress,
  ending just past the learning-rate warm-up (1.2 times its length):
  low-rank compression costs most in loss while the rate climbs and the
  gradient's leading directions move, and the warm-up also aligns the
  factors with them at no extra bytes (docs/guides/trainer.md gives the
  measured effect). A config that changes the learning-rate warm-up sets
  it with ``warmup``, which calls this again."""
  steps = round(1.2 * config.schedule.warmup_steps)
  for name in registry.names():
    if registry.get(name).low_rank:
      config.compressor[name].warmup_steps = steps


def warmup(config: ml_collections.ConfigDict, steps: int) -> None:
  """Sets the learning-rate warm-up to ``steps``, and the dense warm-up
  that ends just past it (``dense_warmup``)."""
  config.schedule.warmup_steps = steps
  dense_warmup(config)


def train_steps(
    config: ml_collections.ConfigDict,
    num_train_steps: int,
    *,
    eval_every: int,
    log_every: int | None = None,
) -> None:
  """Trains for ``num_train_steps``, evaluating and checkpointing every
  ``eval_every`` steps and logging every ``log_every`` (None: as ``config``
  does)."""
  config.num_train_steps = num_train_steps
  config.eval_every_steps = eval_every
  config.checkpoint_every_steps = eval_every
  if log_every is not None:
    config.log_every_steps = log_every


def tfds(
    tfds_name: str, eval_split: str, **fields
) -> ml_collections.ConfigDict:
  """The data: ``tfds_name`` as prepared by ``tfds build`` into
  ~/tensorflow_datasets, trained on its "train" split and evaluated on
  ``eval_split``; ``fields``, the tfds loader's other arguments
  (train/data/tfds.py)."""
  return ml_collections.ConfigDict(
      {
          "name": "tfds",
          "tfds_name": tfds_name,
          "data_dir": "~/tensorflow_datasets",
          "train_split": "train",
          "eval_split": eval_split,
          **fields,
      }
  )


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Seeds the params, the data order and dropout.
  config.seed = 0
  config.num_train_steps = 300
  # Global batch, split evenly over all devices. Set this or
  # per_device_batch_size (which multiplies by the device count), not both.
  config.batch_size = 128
  config.per_device_batch_size = 0
  config.log_every_steps = 1
  # Held-out evaluation every this many steps (0: only at the end).
  config.eval_every_steps = 100
  # Stop at the first evaluation whose held-out loss is at most this (time
  # to quality: the summary's target_step, each evaluation's train_seconds);
  # None: train num_train_steps, which stays the cap.
  config.target_eval_loss = config_dict.placeholder(float)
  # Checkpoint every this many steps (0: only at the end); keep the last K.
  config.checkpoint_every_steps = 100
  config.keep_checkpoints = 3
  # "local": each device normalizes by its own batch and keeps its own
  # running statistics, sending nothing (PyTorch DDP's default). "sync":
  # statistics averaged over all devices each step (counted in bytes_sent).
  config.batch_norm = "local"
  # A step with a non-finite loss, gradient, update or params: "stop" the
  # run before anything of it is saved (the last checkpoint stays good), or
  # "skip" it, keeping the state as it was (as loss scalers do).
  config.nonfinite = "stop"
  # With "skip": a run that skipped more than this share of its steps
  # (resumed parts included) saves its checkpoint, prints its summary and
  # exits non-zero, since what it trained is not what was asked.
  config.max_skipped_fraction = 0.1
  # A step whose training loss (the global mean) exceeds this many times
  # the loss at the start of training has diverged: it is stopped or
  # skipped as nonfinite says, though every number is finite. 0: no guard.
  config.divergence_factor = 1e3
  # Random flips and 4-pixel pad-and-crop of training images.
  config.augment = False
  # Worker processes that read and preprocess batches ahead of the train
  # step (0: the train loop reads each batch itself), and the batches each
  # keeps ready.
  config.data_workers = 0
  config.data_prefetch = 2

  # The model by name (train/models/) with its arguments beside it; the
  # number of classes or the vocabulary comes from the data.
  config.model = ml_collections.ConfigDict({"name": "small_cnn", "width": 32})

  # The loader by name (train/data/) with its arguments beside it.
  config.data = ml_collections.ConfigDict({"name": "digits"})

  # The compressor by name, and each compressor's factory arguments in a
  # dict of its own (e.g. --config.compressor.acp_sgd.rank=8), so that
  # --config.compressor.name=ssgd works here as is and no argument is ever
  # silently ignored. Every argument but keep_dense (a tree or a function)
  # is here, so each can be set from the command line; None stands for the
  # factory's default, typed so that an override parses.
  config.compressor = ml_collections.ConfigDict(
      {
          "name": "acp_sgd",
          **{name: _compressor_args(name) for name in registry.names()},
          # name "auto": the compressor that acp_jax.advise recommends for
          # this model on these workers and link (train/advice.py).
          "auto": {
              # A saved advice (python -m benchmarks advise --json); None:
              # measured at the start.
              "advice": config_dict.placeholder(str),
              # Each worker's link: bytes per second (inf: free), seconds
              # per message.
              "bandwidth": config_dict.placeholder(float),
              "latency": 0.0,
              "workers": 0,  # 0: this run's devices
              # Batches the errors are taken on (the first two warm the
              # factors: acp_jax_tools.advice.STEPS, WARMUP).
              "steps": 4,
              # Steps of a short run of S-SGD and each candidate within the
              # threshold, with this config's optimizer, to rank by the
              # time to S-SGD's loss (0: by the step's time; else >= 8).
              "run_steps": 0,
              # Short runs of each, their batches in other orders: the
              # median of their steps, and their spread as the resolution.
              "run_repeats": 1,
              # The held-out loss gap to S-SGD the threshold promises.
              "max_gap": 0.1,
              # Set by the trainer: the advice it follows, as JSON.
              "picked": config_dict.placeholder(str),
          },
      }
  )

  # The base optimizer after the compressor, by name: "sgd" or "adamw". The
  # learning rate (the schedule's peak) and the weight decay serve every
  # optimizer; each has its own dict beside them, as the compressors do, so
  # --config.optimizer.name=adamw works here as is and setting one
  # optimizer's arguments leaves the other's as they are.
  config.optimizer = ml_collections.ConfigDict(
      {
          "name": "sgd",
          "learning_rate": 0.1,
          # sgd: added to the gradient (L2, carried by momentum, as in
          # PyTorch's SGD); adamw: decoupled, scaled by the learning rate.
          "weight_decay": 0.0,
          "sgd": {"momentum": 0.9, "nesterov": False},  # momentum 0: none
          "adamw": {"b1": 0.9, "b2": 0.999, "eps": 1e-8},
      }
  )
  # Linear warmup, then "constant", "cosine" or "step"; each schedule's own
  # arguments are in a dict of its own beside the name, as the optimizers'
  # are, so --config.schedule.name=step works here as is.
  config.schedule = ml_collections.ConfigDict(
      {
          "name": "cosine",
          "warmup_steps": 20,
          # The learning rate at the end, as a fraction of the peak.
          "cosine": {"end_factor": 0.0},
          # Boundaries as fractions of the steps after warmup, where the
          # learning rate is multiplied by decay_factor.
          "step": {"boundaries": (0.5, 0.75), "decay_factor": 0.1},
      }
  )
  dense_warmup(config)
  return config
