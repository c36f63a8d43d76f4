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
  config.batch_size = 64
  default.train_steps(config, 1000, eval_every=250)
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.weight_decay = 0.01
  config.optimizer.adamw.b2 = 0.99
  default.warmup(config, 50)
  return config
