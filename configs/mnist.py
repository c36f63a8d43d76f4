"""MNIST from IDX files on the small CNN.

The default path is the 10,000-image test set beside this repository (split
8,000 train / 2,000 held out); point --config.data.path at your own copy.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.data.name = "mnist"
  config.data.path = "../shared/data/mnist-t10k"
  config.data.eval_examples = 2000
  config.num_train_steps = 500
  config.batch_size = 128
  return config
