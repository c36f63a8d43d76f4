"""The loader of image classification data sets prepared by TFDS."""

import dataclasses
import os

from train import images as images_lib
from train.data import arguments
from train.data.sources import Dataset
from train.data.sources import TfdsImageSource
from train.data.sources import TfdsSource

# How the tfds loader reads images: as they are, or cropped as for ImageNet.
PREPROCESS = ("none", "imagenet")


@dataclasses.dataclass(frozen=True)
class Tfds:
  """An image classification data set prepared by TFDS as array_record.

  Nothing is downloaded: prepare it first with ``tfds build NAME
  --data_dir=DATA_DIR --file_format=array_record``. Decoding PNG or JPEG
  ``Image`` features needs Pillow or OpenCV.

  ``preprocess="none"`` reads images of one fixed shape as they are, scaled
  to [0, 1]. ``preprocess="imagenet"`` reads images of any size: random
  resized crops and flips for training, central crops for evaluation, both
  ``image_size`` square and normalized by ``mean`` and ``std``. These and the
  other crop arguments are ``images.Preprocess``'s, with its defaults.

  Attributes:
    tfds_name: the data set's TFDS name, e.g. "imagenet2012".
    data_dir: the folder it was prepared in.
    train_split: the split read for training.
    eval_split: the split read for evaluation.
    image_key: the images' feature.
    label_key: the labels' feature, a ``ClassLabel``.
    preprocess: one of ``PREPROCESS``.
  """

  tfds_name: str
  data_dir: str = arguments.path()
  train_split: str = "train"
  eval_split: str = "test"
  image_key: str = "image"
  label_key: str = "label"
  preprocess: str = "none"
  image_size: int = arguments.positive(images_lib.Preprocess.image_size)
  crop_scale: tuple[float, float] = images_lib.Preprocess.crop_scale
  crop_ratio: tuple[float, float] = images_lib.Preprocess.crop_ratio
  crop_fraction: float = images_lib.Preprocess.crop_fraction
  mean: tuple[float, ...] = images_lib.Preprocess.mean
  std: tuple[float, ...] = images_lib.Preprocess.std

  def load(self) -> Dataset:
    if self.preprocess not in PREPROCESS:
      raise ValueError(
          f"config.data.preprocess must be one of {list(PREPROCESS)}, got"
          f" {self.preprocess!r}"
      )
    if self.preprocess == "imagenet":
      crops = images_lib.Preprocess(
          **{
              f.name: getattr(self, f.name)
              for f in dataclasses.fields(images_lib.Preprocess)
          }
      )
    # Only this loader needs TFDS, and its import is slow.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    # TFDS's own error for an unprepared data set is about file formats.
    base_name = self.tfds_name.split(":")[0].split("/")[0]
    if not os.path.isdir(os.path.join(self.data_dir, base_name)):
      raise FileNotFoundError(
          f"config.data.data_dir={self.data_dir} holds no prepared"
          f" {self.tfds_name!r}; run `tfds build {self.tfds_name}"
          f" --data_dir={self.data_dir} --file_format=array_record`"
      )
    features = self._source(self.train_split).dataset_info.features
    for field, key in (
        ("image_key", self.image_key),
        ("label_key", self.label_key),
    ):
      if key not in features:
        raise ValueError(
            f"config.data.{field}={key!r} is not a feature of"
            f" {self.tfds_name}; features: {', '.join(features.keys())}"
        )
    if self.preprocess == "imagenet":
      if not isinstance(features[self.image_key], tfds.features.Image):
        raise ValueError(
            "config.data.preprocess='imagenet' needs encoded images, but"
            f" {self.tfds_name}'s {self.image_key!r} is a"
            f" {type(features[self.image_key]).__name__}"
        )
      return self._cropped(features, crops)
    return self._fixed_shape(features)

  def _source(self, split: str, decoders=None):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    return tfds.data_source(
        self.tfds_name,
        split=split,
        data_dir=self.data_dir,
        download=False,
        decoders=decoders,
    )

  def _cropped(self, features, crops: images_lib.Preprocess) -> Dataset:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    # The images come as bytes: decoding is part of the preprocessing.
    skip = {self.image_key: tfds.decode.SkipDecoding()}

    def source(split: str, train: bool) -> TfdsImageSource:
      return TfdsImageSource(
          self._source(split, skip),
          self.image_key,
          self.label_key,
          crops,
          train,
      )

    return Dataset(
        train=source(self.train_split, True),
        eval=source(self.eval_split, False),
        task="classification",
        num_classes=features[self.label_key].num_classes,
        input_shape=(self.image_size, self.image_size, 3),
    )

  def _fixed_shape(self, features) -> Dataset:
    shape = tuple(features[self.image_key].shape)
    if len(shape) == 2:
      shape += (1,)
    if None in shape:
      raise ValueError(
          f"{self.tfds_name} images have variable shape {shape}; batches"
          " need a fixed one: set config.data.preprocess='imagenet' to crop"
          " them to config.data.image_size"
      )

    def source(split: str) -> TfdsSource:
      return TfdsSource(self._source(split), self.image_key, self.label_key)

    return Dataset(
        train=source(self.train_split),
        eval=source(self.eval_split),
        task="classification",
        num_classes=features[self.label_key].num_classes,
        input_shape=shape,
    )
