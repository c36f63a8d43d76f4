"""A character-level GPT-style LM on tiny-shakespeare (a plain-text file)."""

import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.data = ml_collections.ConfigDict(
      {
          "name": "text",
          # Required: tiny-shakespeare's input.txt (train/data/, DATA_SOURCES).
          "path": "",
          "seq_len": 128,
      }
  )
  config.model = ml_collections.ConfigDict(
      {
          "name": "char_lm",
          "max_len": 128,
          "dim": 128,
          "num_layers": 4,
          "num_heads": 4,
      }
  )
  config.num_train_steps = 1000
  config.batch_size = 64
  config.eval_every_steps = 250
  config.checkpoint_every_steps = 250
  config.optimizer = ml_collections.ConfigDict(
      {
          "name": "adamw",
          "learning_rate": 3e-3,
          "b1": 0.9,
          "b2": 0.99,
          "eps": 1e-8,
          "weight_decay": 0.01,
      }
  )
  config.schedule.warmup_steps = 50
  return config
