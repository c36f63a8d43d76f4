"""The embedded default: digits on a small CNN with ACP-SGD.

Needs no download (scikit-learn's bundled 8x8 digits). Every other config
starts from this one and overrides what differs.
"""

import ml_collections
from ml_collections import config_dict


def _dtype():
  # e.g. --config.compressor.ssgd.comm_dtype=bfloat16; None: the gradients'.
  return config_dict.placeholder(str)


def _bucket_bytes():
  # Uncompressed gradient bytes per bucket; None: 25 MiB, PyTorch DDP's.
  return config_dict.placeholder(float)


def _low_rank():
  """Power-SGD's and ACP-SGD's arguments (see their factories), a fresh
  dict for each, so that setting one leaves the other as it is."""
  return {
      "rank": 4,
      "min_compression_rate": 2.0,
      "use_error_feedback": True,
      "warm_start": True,
      "comm_dtype": _dtype(),
      "warmup_steps": 0,  # dense S-SGD steps before compressing
      "warmup_factors": True,
      "seed": 0,  # the initial factors (the same on every replica)
      "bucket_bytes": _bucket_bytes(),
  }


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
  # Random flips and 4-pixel pad-and-crop of training images.
  config.augment = False
  # Worker processes that read and preprocess batches ahead of the train
  # step (0: the train loop reads each batch itself), and the batches each
  # keeps ready.
  config.data_workers = 0
  config.data_prefetch = 2

  # The model by name (train/models.py) with its arguments beside it; the
  # number of classes or the vocabulary comes from the data.
  config.model = ml_collections.ConfigDict({"name": "small_cnn", "width": 32})

  # The loader by name (train/data.py) with its arguments beside it.
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
          "ssgd": {"comm_dtype": _dtype(), "bucket_bytes": _bucket_bytes()},
          "sign_sgd": {
              "majority_vote": False,
              "bucket_bytes": _bucket_bytes(),
          },
          "topk_sgd": {"density": 0.01, "bucket_bytes": _bucket_bytes()},
          "power_sgd": _low_rank(),
          "acp_sgd": _low_rank(),
          # What it averages: "gradient"; or "momentum", AdamW's first
          # moment after its dense warm-up, the second moment frozen then,
          # or "preconditioned_momentum", that moment over sqrt(nu) + eps
          # (acp_jax.compressed_adam; optimizer adamw, warmup_steps >= 1).
          "compress": "gradient",
      }
  )

  # The base optimizer after the compressor: "sgd" (learning_rate,
  # momentum, nesterov, weight_decay) or "adamw" (learning_rate, b1, b2,
  # eps, weight_decay).
  config.optimizer = ml_collections.ConfigDict(
      {
          "name": "sgd",
          "learning_rate": 0.1,
          "momentum": 0.9,
          "nesterov": False,
          "weight_decay": 0.0,
      }
  )
  # Linear warmup, then "constant", "cosine" (end_factor) or "step"
  # (boundaries as fractions of the steps after warmup, decay_factor).
  config.schedule = ml_collections.ConfigDict(
      {"name": "cosine", "warmup_steps": 20, "end_factor": 0.0}
  )
  return config
