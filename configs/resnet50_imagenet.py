"""ResNet-50 on ImageNet: the paper's setting (64 images per GPU, rank 4).

Real data: `tfds build imagenet2012 --file_format=array_record` (needs the
manually downloaded archives). For throughput runs as in the paper:
  --config.data.name=synthetic_images
"""

import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.data = ml_collections.ConfigDict(
      {
          "name": "tfds",
          "tfds_name": "imagenet2012",
          "data_dir": "~/tensorflow_datasets",
          "train_split": "train",
          "eval_split": "validation",
          # Used by --config.data.name=synthetic_images:
          "image_size": 224,
          "num_classes": 1000,
      }
  )
  config.model = ml_collections.ConfigDict(
      {"name": "resnet50", "stem": "imagenet"}
  )
  config.batch_size = 0
  config.per_device_batch_size = 64
  config.compressor.power_sgd.rank = 4
  config.compressor.acp_sgd.rank = 4
  config.num_train_steps = 450_000
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 5000
  config.optimizer.learning_rate = 0.1
  config.optimizer.weight_decay = 1e-4
  config.schedule = ml_collections.ConfigDict(
      {
          "name": "step",
          "warmup_steps": 2500,
          "boundaries": (1 / 3, 2 / 3, 8 / 9),
          "decay_factor": 0.1,
      }
  )
  return config
