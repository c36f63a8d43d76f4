"""BERT-Base masked-LM pre-training: the paper's setting (32 per GPU, sequence
length 64, rank 32).

We have no tokenized corpus loader, so the tokens are synthetic, as in the
paper's throughput benchmarks.
"""

import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.data = ml_collections.ConfigDict(
      {
          "name": "synthetic_tokens",
          "seq_len": 64,
          "vocab_size": 30522,
          "task": "masked_lm",
      }
  )
  config.model = ml_collections.ConfigDict({"name": "bert", "size": "base"})
  config.batch_size = 0
  config.per_device_batch_size = 32
  config.compressor.power_sgd.rank = 32
  config.compressor.acp_sgd.rank = 32
  default.train_steps(config, 100_000, eval_every=5000, log_every=100)
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 1e-4
  config.optimizer.weight_decay = 0.01
  config.optimizer.adamw.eps = 1e-6
  default.warmup(config, 10_000)
  return config
