"""ResNet-50 on ImageNet: the paper's setting (64 images per GPU, rank 4).

Real data: download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from
image-net.org into ~/tensorflow_datasets/downloads/manual, then
  tfds build imagenet2012 --file_format=array_record \
    --data_dir ~/tensorflow_datasets
and point --config.data.data_dir at that folder. For throughput runs as in
the paper, with nothing to download:
  --config.data.name=synthetic_images
"""

import dataclasses

import ml_collections

from configs import default
from train import images


def get_config():
  config = default.get_config()
  config.data = default.tfds(
      "imagenet2012",
      "validation",
      # Images of any size: random-resized crops and flips for training,
      # resize and central crop for evaluation.
      preprocess="imagenet",
      # The crops' side (also the side of --config.data.name=
      # synthetic_images), a training crop's area (fraction of the image)
      # and aspect ratio, the crop_fraction of the shorter side that
      # evaluation keeps, ImageNet's channel mean and std:
      # images.Preprocess's defaults, here so that each can be set.
      **dataclasses.asdict(images.Preprocess()),
      # Used by --config.data.name=synthetic_images:
      num_classes=1000,
  )
  config.model = ml_collections.ConfigDict(
      {"name": "resnet50", "stem": "imagenet"}
  )
  config.batch_size = 0
  config.per_device_batch_size = 64
  # JPEG decoding and cropping in worker processes, ahead of the step.
  config.data_workers = 8
  default.train_steps(config, 450_000, eval_every=5000, log_every=100)
  config.optimizer.weight_decay = 1e-4
  config.schedule.name = "step"
  config.schedule.step.boundaries = (1 / 3, 2 / 3, 8 / 9)
  default.warmup(config, 2500)
  return config
