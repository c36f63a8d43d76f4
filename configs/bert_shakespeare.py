"""BERT's masked-LM pre-training on tiny-shakespeare (a plain-text file).

A WordPiece tokenizer of data.vocab_size tokens is trained on the first 90%
of the text at the first run and saved beside it (or at data.tokenizer); the
held-out loss is on the last 10%.
"""

import ml_collections

from configs import bert_base
from configs import default


def get_config():
  config = bert_base.get_config()
  config.data = ml_collections.ConfigDict(
      {
          "name": "masked_text",
          # Required: tiny-shakespeare's input.txt (train/data/, DATA_SOURCES).
          "path": "",
          "seq_len": 128,
          "vocab_size": 8192,
          # "": PATH.wordpiece-VOCAB_SIZE.json beside the text.
          "tokenizer": "",
      }
  )
  # A small BERT: 4 layers of width 256.
  config.model = ml_collections.ConfigDict(
      {
          "name": "bert",
          "size": {"num_layers": 4, "hidden": 256, "heads": 4, "ffn": 1024},
          "max_len": 128,
      }
  )
  config.per_device_batch_size = 0
  config.batch_size = 64
  config.num_train_steps = 3000
  config.log_every_steps = 10
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.optimizer.learning_rate = 5e-4
  config.schedule.warmup_steps = 200
  default.dense_warmup(config)
  return config
