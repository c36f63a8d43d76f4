"""ResNet-152 on ImageNet: the paper's setting (32 images per GPU, rank 4)."""

from configs import resnet50_imagenet


def get_config():
  config = resnet50_imagenet.get_config()
  config.model.name = "resnet152"
  config.per_device_batch_size = 32
  return config
