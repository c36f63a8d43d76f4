"""MNIST from IDX files on the small CNN.

The data set is not bundled: point --config.data.path at a folder of MNIST's
IDX files (DATA_SOURCES in train/data/ says where to get them). With only
the 10,000-image test set there, it splits 8,000 train / 2,000 held out.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.data.name = "mnist"
  config.data.path = ""  # required: a folder of IDX files
  config.data.eval_examples = 2000
  config.num_train_steps = 500
  return config
