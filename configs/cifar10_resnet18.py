"""ResNet-18 (CIFAR stem) on CIFAR-10 read by tensorflow-datasets.

Prepare the dataset in array_record format first (with internet):
  tfds build cifar10 --file_format=array_record --data_dir ~/tensorflow_datasets
"""

import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.data = default.tfds(
      "cifar10",
      "test",
      # Used by --config.data.name=synthetic_images:
      image_size=32,
      num_classes=10,
  )
  config.model = ml_collections.ConfigDict(
      {"name": "resnet18", "stem": "cifar"}
  )
  config.augment = True
  config.batch_size = 256
  # 200 epochs at batch 256, evaluated every 10.
  default.train_steps(config, 39_000, eval_every=1950, log_every=50)
  config.optimizer.weight_decay = 5e-4
  default.warmup(config, 390)
  return config
