"""Small data files in the formats of the real data sets, written by tests.

The data sets themselves are not part of the repository. Tests that check
facts of the real files (MNIST's published label counts) read them from the
folder named by the environment variable ``ACP_DATA_DIR``, laid out as the
data sets ship (``mnist-t10k/t10k-images-idx3-ubyte.gz``,
``tinyshakespeare/input.txt``), and skip when it is not set.
"""

import gzip
import os
import pathlib
import struct

import ml_collections
import numpy as np
import pytest

from train import data

DATA_DIR_VARIABLE = "ACP_DATA_DIR"


def build(**config) -> data.Dataset:
  """``train.data.build`` of a config with these fields."""
  return data.build(ml_collections.ConfigDict(config))


def real_data(relative: str) -> str:
  """``$ACP_DATA_DIR/relative``, or a skip that says how to provide it."""
  root = os.environ.get(DATA_DIR_VARIABLE)
  if not root:
    pytest.skip(f"set {DATA_DIR_VARIABLE} to a folder holding {relative}")
  path = os.path.join(root, relative)
  if not os.path.exists(path):
    pytest.skip(f"{path} is not there ({DATA_DIR_VARIABLE}={root})")
  return path


def write_idx(path: pathlib.Path, array: np.ndarray) -> None:
  """``array`` as a gzipped uint8 IDX file, MNIST's format."""
  header = struct.pack(">BBBB", 0, 0, 8, array.ndim)
  header += struct.pack(f">{array.ndim}I", *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def write_mnist(folder: pathlib.Path, size: int, seed: int = 0) -> np.ndarray:
  """A learnable MNIST look-alike of ``size`` images; returns its labels.

  Each class is a bright bar in its own rows, over noise.
  """
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 10, size)
  images = rng.integers(0, 64, (size, 28, 28))
  for i, label in enumerate(labels):
    images[i, 2 * label + 4 : 2 * label + 8] = 255
  write_idx(folder / "t10k-images-idx3-ubyte.gz", images)
  write_idx(folder / "t10k-labels-idx1-ubyte.gz", labels)
  return labels


def write_text(path: pathlib.Path, lines: int, seed: int = 0) -> str:
  """A play-like text of ``lines`` lines; returns it.

  Words are drawn with Zipf-like frequencies from a few thousand made-up
  words, so that a WordPiece tokenizer finds thousands of merges and a model
  can learn the frequencies, as on real prose.
  """
  rng = np.random.default_rng(seed)
  syllables = [c + v for c in "bcdfghlmnprstvw" for v in "aeiou"]
  made_up = {
      "".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(3000)
  }
  vocab = rng.permutation(sorted(made_up))  # sorted: sets have no fixed order
  weights = 1 / np.arange(1, len(vocab) + 1)
  lengths = rng.integers(4, 12, lines)
  words = rng.choice(vocab, lengths.sum(), p=weights / weights.sum())
  ends = rng.choice([",", ".", "!", "?"], lines)
  speakers = ["FIRST CITIZEN", "MENENIUS", "ROMEO", "JULIET"]
  out = []
  for i, line in enumerate(np.split(words, np.cumsum(lengths)[:-1])):
    if i % 4 == 0:
      out.append(f"\n{speakers[i // 4 % 4]}:\n")
    out.append(" ".join(line).capitalize() + ends[i] + "\n")
  text = "".join(out)
  path.write_text(text, encoding="utf-8")
  return text
