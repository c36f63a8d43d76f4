"""BERT-Large masked-LM pre-training: the paper's setting (8 per GPU,
sequence length 64, rank 32), on synthetic tokens."""

from configs import bert_base


def get_config():
  config = bert_base.get_config()
  config.model.size = "large"
  config.per_device_batch_size = 8
  return config
