"""ResNet-18 (CIFAR stem) on CIFAR-10 read by tensorflow-datasets.

Prepare the dataset in array_record format first (with internet):
  tfds build cifar10 --file_format=array_record --data_dir ~/tensorflow_datasets
"""

import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.data = ml_collections.ConfigDict(
      {
          "name": "tfds",
          "tfds_name": "cifar10",
          "data_dir": "~/tensorflow_datasets",
          "train_split": "train",
          "eval_split": "test",
          # Used by --config.data.name=synthetic_images:
          "image_size": 32,
          "num_classes": 10,
      }
  )
  config.model = ml_collections.ConfigDict(
      {"name": "resnet18", "stem": "cifar"}
  )
  config.augment = True
  config.num_train_steps = 39_000  # 200 epochs at batch 256
  config.batch_size = 256
  config.eval_every_steps = 1950
  config.checkpoint_every_steps = 1950
  config.log_every_steps = 50
  config.optimizer.learning_rate = 0.1
  config.optimizer.weight_decay = 5e-4
  config.schedule.warmup_steps = 390
  default.dense_warmup(config)
  return config
