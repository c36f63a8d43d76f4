"""Tests of train/data/: loaders on files in the data sets' formats, batch
order, errors; the real data sets too where ``ACP_DATA_DIR`` has them."""

import collections
import gzip
import math
import os

import numpy as np
import pytest

from tests import datafiles
from train import data
from train import images

# Label counts of MNIST's t10k file, as published with the data set.
T10K_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _numbered(size: int) -> data.ArraySource:
  """Example i has inputs i, so a batch's inputs are its example indices."""
  return data.ArraySource(
      {
          "inputs": np.arange(size, dtype=np.int32),
          "targets": np.arange(size, dtype=np.int32),
          "weights": np.ones(size, np.float32),
      }
  )


@pytest.fixture(scope="module")
def digits():
  return datafiles.build(name="digits")


@pytest.fixture(scope="module")
def small_images():
  return datafiles.build(name="synthetic_images", image_size=8, num_classes=10)


# Batch order.


def test_batch_is_a_function_of_seed_and_step(small_images):
  def loader(seed):
    return data.Loader(
        small_images.train, global_batch=16, seed=seed, augment=True
    )

  first, resumed = loader(3), loader(3)
  for step in (0, 1, 17, 5):
    a, b = first.batch(step), resumed.batch(step)
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(
      loader(3).batch(5)["targets"], loader(4).batch(5)["targets"]
  )


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_sees_every_example_once(shuffle):
  size, batch = 10, 3  # Batches straddle every epoch boundary but the 3rd.
  loader = data.Loader(
      _numbered(size), global_batch=batch, seed=0, shuffle=shuffle
  )
  steps = math.ceil(3 * size / batch)
  stream = np.concatenate([loader.batch(s)["inputs"] for s in range(steps)])
  epochs = stream[: 3 * size].reshape(3, size)
  for epoch in epochs:
    np.testing.assert_array_equal(np.sort(epoch), np.arange(size))
  if shuffle:
    assert not np.array_equal(epochs[0], epochs[1])
    np.testing.assert_array_equal(
        epochs[1], np.random.default_rng((0, 1)).permutation(size)
    )
  else:
    np.testing.assert_array_equal(epochs, np.tile(np.arange(size), (3, 1)))
  assert loader.position(0) == {"epoch": 0, "index": 0}
  assert loader.position(4) == {"epoch": 1, "index": 2}
  assert loader.position(10) == {"epoch": 3, "index": 0}


def test_processes_split_the_global_batch(small_images):
  def batch(index, count):
    loader = data.Loader(
        small_images.train,
        global_batch=12,
        seed=1,
        process_index=index,
        process_count=count,
        augment=True,
    )
    return loader.batch(7)

  whole = batch(0, 1)
  halves = [batch(0, 2), batch(1, 2)]
  for key in whole:
    assert halves[0][key].shape[0] == 6
    np.testing.assert_array_equal(
        np.concatenate([h[key] for h in halves]), whole[key]
    )


def test_augment_flips_and_shifts_each_image(digits):
  plain = data.Loader(digits.train, global_batch=8, seed=2).batch(3)
  augmented = data.Loader(
      digits.train, global_batch=8, seed=2, augment=True
  ).batch(3)
  np.testing.assert_array_equal(plain["targets"], augmented["targets"])
  assert augmented["inputs"].shape == plain["inputs"].shape
  assert not np.array_equal(augmented["inputs"], plain["inputs"])
  padded = np.pad(plain["inputs"], ((0, 0), (4, 4), (4, 4), (0, 0)))
  for image, out in zip(padded, augmented["inputs"]):
    crops = [
        view[dy : dy + 8, dx : dx + 8]
        for view in (image, image[:, ::-1])
        for dy in range(9)
        for dx in range(9)
    ]
    assert any(np.array_equal(crop, out) for crop in crops)


def test_eval_batches_cover_the_split_once():
  size, batch = 10, 4
  batches = list(data.eval_batches(_numbered(size), global_batch=batch))
  assert len(batches) == 3
  inputs = np.concatenate([b["inputs"] for b in batches])
  weights = np.concatenate([b["weights"] for b in batches])
  assert inputs.shape == (12,)
  assert weights.sum() == size
  np.testing.assert_array_equal(inputs[weights > 0], np.arange(size))
  # Padding copies the last batch's row 0.
  np.testing.assert_array_equal(inputs[weights == 0], [8, 8])

  per_process = [
      list(
          data.eval_batches(
              _numbered(size),
              global_batch=batch,
              process_index=i,
              process_count=2,
          )
      )
      for i in range(2)
  ]
  for step, whole in enumerate(batches):
    for key in whole:
      np.testing.assert_array_equal(
          np.concatenate([p[step][key] for p in per_process]), whole[key]
      )


def test_eval_batches_zero_padding_weights_of_sequences():
  lm = datafiles.build(name="synthetic_tokens", seq_len=8, num_examples=5)
  batches = list(data.eval_batches(lm.eval, global_batch=4))
  assert [b["weights"].shape for b in batches] == [(4, 8), (4, 8)]
  np.testing.assert_array_equal(batches[1]["weights"][1:], 0)
  total = sum(b["weights"].sum() for b in batches)
  assert total == lm.eval.get(np.arange(5))["weights"].sum()


# Loaders.


def test_digits_fixed_split(digits):
  from sklearn import datasets  # pylint: disable=g-import-not-at-top

  assert (len(digits.train), len(digits.eval)) == (1437, 360)
  assert digits.task == "classification"
  assert (digits.num_classes, digits.input_shape) == (10, (8, 8, 1))
  batch = digits.train.get(np.arange(len(digits.train)))
  assert batch["inputs"].shape == (1437, 8, 8, 1)
  assert batch["inputs"].dtype == np.float32
  assert batch["inputs"].min() == 0 and batch["inputs"].max() == 1
  assert batch["targets"].dtype == np.int32
  # Train and eval partition the data set.
  labels = np.concatenate(
      [batch["targets"], digits.eval.get(np.arange(360))["targets"]]
  )
  np.testing.assert_array_equal(
      np.bincount(labels), np.bincount(datasets.load_digits().target)
  )
  order = np.random.default_rng(0).permutation(1797)
  np.testing.assert_array_equal(
      digits.eval.get(np.arange(360))["inputs"][..., 0] * 16,
      datasets.load_digits().images[order[-360:]],
  )


def test_mnist_from_idx_files(tmp_path):
  labels = datafiles.write_mnist(tmp_path, 500)
  raw = data.read_idx(str(tmp_path / "t10k-images-idx3-ubyte.gz"), 3)
  mnist = datafiles.build(name="mnist", path=str(tmp_path), eval_examples=100)
  assert (len(mnist.train), len(mnist.eval)) == (400, 100)
  assert (mnist.num_classes, mnist.input_shape) == (10, (28, 28, 1))
  train = mnist.train.get(np.arange(400))
  eval_ = mnist.eval.get(np.arange(100))
  assert train["inputs"].dtype == np.float32
  assert train["inputs"].min() == 0 and train["inputs"].max() == 1
  # The eval split is the file's last images, in order.
  np.testing.assert_array_equal(
      np.concatenate([train["targets"], eval_["targets"]]), labels
  )
  np.testing.assert_array_equal(eval_["inputs"][..., 0] * 255, raw[400:])


def test_mnist_reads_train_files_before_t10k(tmp_path):
  datafiles.write_mnist(tmp_path, 30, seed=1)
  test_labels = data.read_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), 1)
  labels = np.arange(20) % 10
  datafiles.write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels)
  datafiles.write_idx(
      tmp_path / "train-images-idx3-ubyte.gz", np.zeros((20, 28, 28))
  )
  mnist = datafiles.build(name="mnist", path=str(tmp_path), eval_examples=30)
  np.testing.assert_array_equal(
      mnist.train.get(np.arange(20))["targets"], labels
  )
  np.testing.assert_array_equal(
      mnist.eval.get(np.arange(30))["targets"], test_labels
  )


def test_mnist_t10k():
  """MNIST's real test set, where ACP_DATA_DIR holds it."""
  mnist_dir = datafiles.real_data("mnist-t10k")
  mnist = datafiles.build(name="mnist", path=mnist_dir)
  assert (len(mnist.train), len(mnist.eval)) == (8000, 2000)
  assert (mnist.num_classes, mnist.input_shape) == (10, (28, 28, 1))
  train = mnist.train.get(np.arange(8000))
  eval_ = mnist.eval.get(np.arange(2000))
  assert train["inputs"].dtype == np.float32
  assert train["inputs"].shape == (8000, 28, 28, 1)
  assert train["inputs"].min() == 0 and train["inputs"].max() == 1
  # Digits are mostly background: about a fifth of the pixels are ink.
  assert 0.1 < (train["inputs"] > 0.5).mean() < 0.3
  labels = np.concatenate([train["targets"], eval_["targets"]])
  np.testing.assert_array_equal(np.bincount(labels), T10K_LABEL_COUNTS)
  assert np.bincount(eval_["targets"], minlength=10).min() > 150
  raw = data.read_idx(os.path.join(mnist_dir, "t10k-images-idx3-ubyte.gz"), 3)
  np.testing.assert_array_equal(eval_["inputs"][0, ..., 0] * 255, raw[8000])

  other = datafiles.build(name="mnist", path=mnist_dir, eval_examples=500)
  assert (len(other.train), len(other.eval)) == (9500, 500)


def test_idx_reader_checks_the_header(tmp_path):
  good = tmp_path / "x-labels-idx1-ubyte"
  good.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
  np.testing.assert_array_equal(data.read_idx(str(good), 1), [7, 8, 9])
  with pytest.raises(ValueError, match="expected 3"):
    data.read_idx(str(good), 3)

  bad_magic = tmp_path / "bad-images-idx3-ubyte.gz"
  with gzip.open(bad_magic, "wb") as f:
    f.write(bytes([1, 2, 8, 3]) + bytes(12))
  with pytest.raises(ValueError, match="not a uint8 IDX file"):
    data.read_idx(str(bad_magic), 3)

  short = tmp_path / "short-labels-idx1-ubyte"
  short.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1]))
  with pytest.raises(ValueError, match="expected 5"):
    data.read_idx(str(short), 1)


def test_damaged_files_are_named(tmp_path):
  truncated = tmp_path / "t10k-images-idx3-ubyte.gz"
  with gzip.open(truncated, "wb") as f:
    f.write(bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2]) + bytes(8))
  truncated.write_bytes(truncated.read_bytes()[:-12])
  with pytest.raises(ValueError, match=f"{truncated} cannot be read"):
    data.read_idx(str(truncated), 3)
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("caf\xe9 ".encode("latin-1") * 100)
  with pytest.raises(ValueError, match=f"{latin1} is not UTF-8 text"):
    datafiles.build(name="text", path=str(latin1))


def test_mnist_labels_out_of_range_are_refused(tmp_path):
  (tmp_path / "t10k-images-idx3-ubyte").write_bytes(
      bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0])
  )
  labels = tmp_path / "t10k-labels-idx1-ubyte"
  labels.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 2, 3, 12]))
  with pytest.raises(ValueError, match=f"{labels} holds label 12"):
    datafiles.build(name="mnist", path=str(tmp_path), eval_examples=1)


def test_mnist_needs_labels_for_each_images_file(tmp_path):
  (tmp_path / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]))
  with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
    datafiles.build(name="mnist", path=str(tmp_path))


def _check_text(path: str) -> tuple[data.Dataset, str]:
  """The char loader's invariants on the text at ``path``."""
  text = datafiles.build(name="text", path=path)
  with open(path, encoding="utf-8") as f:
    chars = f.read()
  assert text.task == "causal_lm"
  assert text.num_classes == len(set(chars))
  assert text.input_shape == (128,)
  train_chars = int(0.9 * len(chars))
  assert len(text.train) == (train_chars - 1) // 128
  assert len(text.eval) == (len(chars) - train_chars - 1) // 128

  batch = text.train.get(np.array([0, 1, 2]))
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
  np.testing.assert_array_equal(
      batch["targets"][:, :-1], batch["inputs"][:, 1:]
  )
  # Chunks follow each other: each starts with the previous one's last target.
  np.testing.assert_array_equal(
      batch["inputs"][1:, 0], batch["targets"][:-1, -1]
  )
  np.testing.assert_array_equal(batch["weights"], 1)
  vocab = text.train.vocab
  assert "".join(vocab[t] for t in batch["inputs"][0]) == chars[:128]
  last_index = len(text.eval) - 1
  last = text.eval.get(np.array([last_index]))
  start = train_chars + last_index * 128
  assert (
      "".join(vocab[t] for t in last["targets"][0])
      == chars[start + 1 : start + 129]
  )
  return text, chars


def test_text_from_a_file(tmp_path):
  path = tmp_path / "play.txt"
  datafiles.write_text(path, 400)
  _check_text(str(path))


def test_text_tinyshakespeare():
  """tiny-shakespeare's counts, where ACP_DATA_DIR holds it."""
  text, _ = _check_text(datafiles.real_data("tinyshakespeare/input.txt"))
  assert text.num_classes == 65
  assert (len(text.train), len(text.eval)) == (7842, 871)


def test_synthetic_masked_lm():
  lm = datafiles.build(name="synthetic_tokens", seq_len=64, num_examples=32)
  assert (lm.task, lm.num_classes, lm.input_shape) == (
      "masked_lm",
      30522,
      (64,),
  )
  batch = lm.train.get(np.arange(32))
  masked = batch["weights"] == 1
  np.testing.assert_array_equal(masked.sum(axis=1), round(0.15 * 64))
  assert set(np.unique(batch["weights"])) == {0.0, 1.0}
  np.testing.assert_array_equal(batch["inputs"][masked], data.MASK_ID)
  np.testing.assert_array_equal(
      batch["inputs"][~masked], batch["targets"][~masked]
  )
  assert (batch["targets"] != data.MASK_ID).all()
  assert batch["targets"].max() < 30522
  assert not np.array_equal(
      batch["targets"], lm.eval.get(np.arange(32))["targets"]
  )


def test_synthetic_causal_lm_and_images(small_images):
  lm = datafiles.build(name="synthetic_tokens", task="causal_lm", vocab_size=50)
  batch = lm.train.get(np.arange(4))
  np.testing.assert_array_equal(
      batch["targets"][:, :-1], batch["inputs"][:, 1:]
  )
  np.testing.assert_array_equal(batch["weights"], 1)
  images = small_images.train.get(np.arange(256))
  assert images["inputs"].shape == (256, 8, 8, 3)
  assert 0 <= images["inputs"].min() and images["inputs"].max() <= 1
  assert images["targets"].max() < 10


# Errors, all raised before any data is read.


@pytest.mark.parametrize(
    "config, error, message",
    [
        ({"name": "cifar"}, ValueError, "digits, mnist, text, tfds"),
        ({"name": "digits", "pth": "/x"}, ValueError, "config.data.pth"),
        ({"name": "text", "seq_lne": 8}, ValueError, "config.data.seq_lne"),
        ({"name": "mnist"}, ValueError, "needs config.data.path"),
        (
            {"name": "mnist", "path": "/no/such/dir"},
            FileNotFoundError,
            "config.data.path=/no/such/dir does not exist",
        ),
        (
            {"name": "tfds", "tfds_name": "mnist", "data_dir": "/no/tfds"},
            FileNotFoundError,
            "config.data.data_dir=/no/tfds does not exist",
        ),
        (
            {"name": "synthetic_tokens", "seq_len": 0},
            ValueError,
            "config.data.seq_len",
        ),
        (
            {"name": "synthetic_tokens", "task": "mlm"},
            ValueError,
            "config.data.task",
        ),
    ],
)
def test_build_errors(config, error, message):
  with pytest.raises(error, match=message):
    datafiles.build(**config)


def test_arguments_of_other_loaders_are_ignored():
  """One override of the name switches a config to synthetic data."""
  data = datafiles.build(
      name="synthetic_images",
      image_size=8,
      num_classes=3,
      tfds_name="imagenet2012",
      data_dir="/no/tfds",
  )
  assert data.input_shape == (8, 8, 3) and data.num_classes == 3


def test_batch_split_errors():
  source = _numbered(10)
  message = "global_batch=10 is not divisible by process_count=3"
  with pytest.raises(ValueError, match=message):
    data.Loader(source, global_batch=10, seed=0, process_count=3)
  with pytest.raises(ValueError, match=message):
    next(data.eval_batches(source, global_batch=10, process_count=3))
  with pytest.raises(ValueError, match="global_batch"):
    data.Loader(source, global_batch=0, seed=0)
  with pytest.raises(ValueError, match="augment"):
    data.Loader(source, global_batch=2, seed=0, augment=True)


# TFDS: a tiny data set written as array_record, read by tfds.data_source.


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  tfds = pytest.importorskip("tensorflow_datasets")
  root = str(tmp_path_factory.mktemp("tfds"))
  rng = np.random.default_rng(0)
  splits = {
      "train": rng.integers(0, 256, (10, 4, 4, 3), dtype=np.uint8),
      "test": rng.integers(0, 256, (3, 4, 4, 3), dtype=np.uint8),
  }

  # Tensor, not Image: encoding PNG needs TensorFlow, absent here.
  images.write_tfds_dataset(
      root,
      "AcpTinyImages",
      {
          "pixels": tfds.features.Tensor(shape=(4, 4, 3), dtype=np.uint8),
          "label": tfds.features.ClassLabel(num_classes=5),
      },
      {
          split: [
              {"pixels": image, "label": i % 5}
              for i, image in enumerate(examples)
          ]
          for split, examples in splits.items()
      },
  )
  return root, splits


def test_tfds_array_record(tfds_dir):
  root, splits = tfds_dir
  tiny = datafiles.build(
      name="tfds",
      tfds_name="acp_tiny_images",
      data_dir=root,
      image_key="pixels",
  )
  assert (len(tiny.train), len(tiny.eval)) == (10, 3)
  assert (tiny.num_classes, tiny.input_shape) == (5, (4, 4, 3))
  batch = tiny.train.get(np.arange(10))
  assert batch["inputs"].dtype == np.float32
  assert batch["targets"].dtype == np.int32
  # TFDS shuffles records when writing, so compare as sets of examples.
  written = {
      (image.tobytes(), i % 5) for i, image in enumerate(splits["train"])
  }
  read = {
      ((x * 255).round().astype(np.uint8).tobytes(), int(y))
      for x, y in zip(batch["inputs"], batch["targets"])
  }
  assert read == written
  order = [1, 7, 3]
  np.testing.assert_array_equal(
      tiny.train.get(np.array(order))["inputs"], batch["inputs"][order]
  )
  counts = collections.Counter(
      int(y)
      for b in data.eval_batches(tiny.eval, global_batch=2)
      for y, w in zip(b["targets"], b["weights"])
      if w
  )
  assert counts == {0: 1, 1: 1, 2: 1}


def test_tfds_errors(tfds_dir):
  root, _ = tfds_dir
  with pytest.raises(FileNotFoundError, match="no prepared 'cifar10'"):
    datafiles.build(name="tfds", tfds_name="cifar10", data_dir=root)
  with pytest.raises(ValueError, match="config.data.image_key='image'"):
    datafiles.build(name="tfds", tfds_name="acp_tiny_images", data_dir=root)


def test_tfds_source_reads_one_record_at_a_time_without_getitems():
  # A list has __getitem__ but no __getitems__, like older TFDS sources.
  records = [
      {"image": np.full((2, 2), i, np.uint8), "label": np.int64(i)}
      for i in range(4)
  ]
  batch = data.TfdsSource(records, "image", "label").get(np.array([3, 0]))
  assert batch["inputs"].shape == (2, 2, 2, 1)
  np.testing.assert_allclose(batch["inputs"][:, 0, 0, 0], [3 / 255, 0])
  np.testing.assert_array_equal(batch["targets"], [3, 0])
