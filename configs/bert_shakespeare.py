"""BERT's masked-LM pre-training on tiny-shakespeare (a plain-text file).

A WordPiece tokenizer of data.vocab_size tokens is trained on the first 90%
of the text at the first run and saved beside it (or at data.tokenizer); the
held-out loss is on the last 10%.
"""

import ml_collections

from configs import bert_base
from configs import default
from configs import tinyshakespeare


def get_config():
  config = bert_base.get_config()
  # The char LM's text and sequences, masked.
  config.data = tinyshakespeare.get_config().data
  config.data.name = "masked_text"
  config.data.vocab_size = 8192
  # "": PATH.wordpiece-VOCAB_SIZE.json beside the text.
  config.data.tokenizer = ""
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
  default.train_steps(config, 3000, eval_every=500, log_every=10)
  config.optimizer.learning_rate = 5e-4
  default.warmup(config, 200)
  return config
