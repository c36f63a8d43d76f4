"""ImageNet-style preprocessing of encoded images of any size.

Training: decode, a random crop of random area and aspect ratio resized to
``image_size`` (the "Inception" crop), a random horizontal flip, per-channel
normalization. Evaluation: decode, resize the shorter side to
``image_size / crop_fraction``, a central ``image_size`` square, the same
normalization. Each training example's randomness comes from a NumPy
generator that the caller derives from (seed, the example's position in the
stream), so a batch does not depend on which process or thread decodes it.
"""

import dataclasses
import io
import math
from typing import Any

import numpy as np
from PIL import Image

from train import checks

# Channel statistics of ImageNet's training set, on the [0, 1] scale.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _pair(name: str, value) -> tuple[float, float]:
  try:
    low, high = (float(v) for v in value)
  except (TypeError, ValueError):
    raise ValueError(
        f"config.data.{name} must be a pair (low, high), got {value!r}"
    ) from None
  if not 0 < low <= high:
    raise ValueError(
        f"config.data.{name} must satisfy 0 < low <= high, got {value!r}"
    )
  return low, high


@dataclasses.dataclass(frozen=True)
class Preprocess:
  """The arguments of the crops and the normalization, checked once.

  Attributes:
    image_size: the side of the square crops, in pixels.
    crop_scale: the range of a training crop's area, as a fraction of the
      image's; (0.08, 1) as in the Inception and ResNet papers.
    crop_ratio: the range of a training crop's width / height, drawn
      log-uniformly.
    crop_fraction: evaluation crops this fraction of the shorter side after
      resizing (0.875: 224 of 256).
    mean: per-channel means subtracted from pixels scaled to [0, 1].
    std: per-channel standard deviations they are divided by.
  """

  image_size: int = 224
  crop_scale: tuple[float, float] = (0.08, 1.0)
  crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
  crop_fraction: float = 0.875
  mean: tuple[float, ...] = IMAGENET_MEAN
  std: tuple[float, ...] = IMAGENET_STD

  def __post_init__(self):
    checks.integer("config.data.image_size", self.image_size, 1)
    scale = _pair("crop_scale", self.crop_scale)
    if scale[1] > 1:
      raise ValueError(
          "config.data.crop_scale must lie in (0, 1], got"
          f" {self.crop_scale!r}"
      )
    object.__setattr__(self, "crop_scale", scale)
    object.__setattr__(self, "crop_ratio", _pair("crop_ratio", self.crop_ratio))
    fraction = self.crop_fraction
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
      raise ValueError(
          f"config.data.crop_fraction must lie in (0, 1], got {fraction!r}"
      )
    for name in ("mean", "std"):
      value = getattr(self, name)
      if np.ndim(value) != 1 or len(value) != 3:
        raise ValueError(
            f"config.data.{name} must hold 3 numbers (R, G, B), got {value!r}"
        )
      object.__setattr__(self, name, tuple(float(v) for v in value))
    if min(self.std) <= 0:
      raise ValueError(f"config.data.std must be positive, got {self.std!r}")

  def normalize(self, pixels: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] pixels as float32 ``(pixels / 255 - mean) / std``."""
    mean = np.float32(255) * np.array(self.mean, np.float32)
    inverse = 1 / (np.float32(255) * np.array(self.std, np.float32))
    return (pixels.astype(np.float32) - mean) * inverse


def decode(encoded: bytes) -> Image.Image:
  """An encoded image (JPEG, PNG, ...) as RGB, whatever its own mode."""
  image = Image.open(io.BytesIO(encoded))
  return image.convert("RGB") if image.mode != "RGB" else image


def random_crop_box(
    width: int, height: int, preprocess: Preprocess, rng: np.random.Generator
) -> tuple[int, int, int, int]:
  """(left, top, right, bottom) of a random crop of an image.

  Tries ten times for a crop of area ``crop_scale`` x the image's and aspect
  ratio ``crop_ratio`` that fits in the image; failing that, the central crop
  of the image at the ratio nearest to the range. As torchvision's
  ``RandomResizedCrop``.
  """
  area = width * height
  log_ratio = np.log(preprocess.crop_ratio)
  for _ in range(10):
    target = area * rng.uniform(*preprocess.crop_scale)
    ratio = math.exp(rng.uniform(*log_ratio))
    w = round(math.sqrt(target * ratio))
    h = round(math.sqrt(target / ratio))
    if 0 < w <= width and 0 < h <= height:
      left = int(rng.integers(0, width - w + 1))
      top = int(rng.integers(0, height - h + 1))
      return left, top, left + w, top + h
  low, high = preprocess.crop_ratio
  ratio = width / height
  if ratio < low:
    w, h = width, round(width / low)
  elif ratio > high:
    w, h = round(height * high), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return left, top, left + w, top + h


def train_image(
    encoded: bytes, preprocess: Preprocess, rng: np.random.Generator
) -> np.ndarray:
  """float32 [size, size, 3]: random-resized crop, random flip, normalized."""
  image = decode(encoded)
  box = random_crop_box(*image.size, preprocess, rng)
  size = preprocess.image_size
  image = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
  pixels = np.asarray(image)
  if rng.random() < 0.5:
    pixels = pixels[:, ::-1]
  return preprocess.normalize(pixels)


def eval_image(encoded: bytes, preprocess: Preprocess) -> np.ndarray:
  """float32 [size, size, 3]: shorter side resized, center crop, normalized."""
  image = decode(encoded)
  size = preprocess.image_size
  shorter = max(size, round(size / preprocess.crop_fraction))
  width, height = image.size
  scale = shorter / min(width, height)
  width, height = max(size, round(width * scale)), max(
      size, round(height * scale)
  )
  image = image.resize((width, height), Image.Resampling.BILINEAR)
  left, top = (width - size) // 2, (height - size) // 2
  image = image.crop((left, top, left + size, top + size))
  return preprocess.normalize(np.asarray(image))


def write_tfds_dataset(
    data_dir: str,
    class_name: str,
    features: dict[str, Any],
    splits: dict[str, list[dict[str, Any]]],
) -> str:
  """Writes ``splits`` (each a list of examples) with TFDS as array_record,
  the data set's features ``features``; returns its name (``class_name`` in
  snake case, as TFDS names builders).

  The builder is not registered: readers find the data set from its files
  alone, as they would one prepared elsewhere.
  """
  # TFDS is needed by this function alone, and its import is slow.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def info(self):
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict(features)
    )

  def split_generators(self, dl_manager):
    del dl_manager
    return {name: enumerate(examples) for name, examples in splits.items()}

  with tfds.core.registered.skip_registration():
    builder = type(
        class_name,
        (tfds.core.GeneratorBasedBuilder,),
        {
            "VERSION": tfds.core.Version("1.0.0"),
            # No checksums file to look for beside the code.
            "code_path": None,
            "_info": info,
            "_split_generators": split_generators,
            "_generate_examples": None,
        },
    )(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return builder.name


def write_jpeg_dataset(
    data_dir: str,
    *,
    splits: dict[str, int],
    num_classes: int,
    sizes: tuple[int, int] = (20, 80),
    seed: int = 0,
) -> str:
  """Writes a small data set of JPEGs of random sizes with TFDS, as
  array_record, for tests and benchmarks; returns its name.

  Each image is a random colour gradient, ``sizes`` bounding its sides; its
  label is its index modulo ``num_classes``. Nothing needs TensorFlow: the
  JPEGs are encoded with Pillow and handed to TFDS as bytes.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  examples = {}
  for split, count in splits.items():
    examples[split] = []
    for i in range(count):
      h, w = rng.integers(sizes[0], sizes[1] + 1, 2)
      corners = rng.integers(0, 256, (2, 3))
      t = (np.arange(h)[:, None, None] + np.arange(w)[None, :, None]) / (h + w)
      pixels = ((1 - t) * corners[0] + t * corners[1]).astype(np.uint8)
      out = io.BytesIO()
      Image.fromarray(pixels).save(out, format="JPEG", quality=90)
      examples[split].append(
          {"image": out.getvalue(), "label": i % num_classes}
      )
  return write_tfds_dataset(
      data_dir,
      "AcpJpegImages",
      {
          "image": tfds.features.Image(
              shape=(None, None, 3), encoding_format="jpeg"
          ),
          "label": tfds.features.ClassLabel(num_classes=num_classes),
      },
      examples,
  )
