"""MNIST's IDX files: the array format, and a folder of image and label files."""

import gzip
import math
import os
import zlib

import numpy as np

_IDX_DTYPES = {0x08: np.uint8}
_IMAGES_SUFFIX = "-images-idx3-ubyte"
_LABELS_SUFFIX = "-labels-idx1-ubyte"


def read_idx(path: str, ndim: int) -> np.ndarray:
  """An unsigned-byte IDX array (MNIST's format), gzipped or not.

  The header is two zero bytes, a dtype code (0x08: uint8), the number of
  dimensions, then each dimension as a big-endian uint32.

  Args:
    path: the file; read through gzip when it ends in ``.gz``.
    ndim: the number of dimensions the file must have (3 for images, 1 for
      labels).

  Returns:
    The array, uint8, with the file's shape.

  Raises:
    ValueError: if the header is not that of a uint8 IDX file with ``ndim``
      dimensions, or the data has the wrong length.
  """
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # a damaged gzip stream
    raise ValueError(f"{path} cannot be read: {e}") from None
  if len(data) < 4 or data[:2] != b"\0\0" or data[2] not in _IDX_DTYPES:
    raise ValueError(
        f"{path} is not a uint8 IDX file: magic bytes {data[:4].hex()},"
        f" expected 0000080{ndim}"
    )
  if data[3] != ndim:
    raise ValueError(f"{path} has {data[3]} dimensions, expected {ndim}")
  header = 4 + 4 * ndim
  shape = tuple(int(d) for d in np.frombuffer(data[4:header], ">u4"))
  if len(data) - header != math.prod(shape):
    raise ValueError(
        f"{path} holds {len(data) - header} bytes after its header, expected"
        f" {math.prod(shape)} for shape {shape}"
    )
  return np.frombuffer(data, _IDX_DTYPES[data[2]], offset=header).reshape(shape)


def _idx_file(directory: str, stem: str) -> str | None:
  # Prefer the uncompressed file: it is the one a user unpacked on purpose.
  for name in (stem, stem + ".gz"):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def read_mnist(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Images uint8 [N, H, W, 1] and labels uint8 [N] from a folder of IDX files.

  Every ``PREFIX-images-idx3-ubyte[.gz]`` in ``path`` is read with its
  ``PREFIX-labels-idx1-ubyte[.gz]``, ``train`` files before ``t10k`` files.

  Raises:
    NotADirectoryError: if ``path`` is not a folder.
    FileNotFoundError: if it holds no images file, or an images file without
      its labels file.
    ValueError: if a file is not an IDX file of its kind, a label is not a
      digit, or the images and labels of a prefix differ in number.
  """
  if not os.path.isdir(path):
    raise NotADirectoryError(f"config.data.path={path} is not a directory")
  prefixes = sorted(
      {
          name.split(_IMAGES_SUFFIX)[0]
          for name in os.listdir(path)
          if name.endswith((_IMAGES_SUFFIX, _IMAGES_SUFFIX + ".gz"))
      },
      key=lambda p: (p.startswith("t10k"), p),
  )
  if not prefixes:
    raise FileNotFoundError(
        f"config.data.path={path} holds no *{_IMAGES_SUFFIX}[.gz] file"
    )
  images, labels = [], []
  for prefix in prefixes:
    labels_file = _idx_file(path, prefix + _LABELS_SUFFIX)
    if labels_file is None:
      raise FileNotFoundError(
          f"config.data.path={path} has {prefix}{_IMAGES_SUFFIX} but no"
          f" {prefix}{_LABELS_SUFFIX}[.gz]"
      )
    images_file = _idx_file(path, prefix + _IMAGES_SUFFIX)
    images.append(read_idx(images_file, 3))
    labels.append(read_idx(labels_file, 1))
    if labels[-1].size and labels[-1].max() >= 10:
      # Out-of-range labels would make the loss NaN at the first step.
      raise ValueError(
          f"{labels_file} holds label {labels[-1].max()}; MNIST's classes"
          " are 0-9"
      )
    if len(images[-1]) != len(labels[-1]):
      raise ValueError(
          f"{images_file} has {len(images[-1])} images but {labels_file} has"
          f" {len(labels[-1])} labels"
      )
  return np.concatenate(images)[..., None], np.concatenate(labels)
