"""Images of any size through TFDS: crops, normalization, the grain pipeline
with worker processes, and ResNet-18 trained and resumed through it."""

import gc
import io
import math
import multiprocessing
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from configs import resnet50_imagenet
from tests import datafiles
from train import data
from train import images
from train import pipeline
from train import train

NUM_CLASSES = 10
# Sides of 20 to 80 pixels: no two images need have the same shape.
SPLITS = {"train": 240, "test": 40}


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory):
  pytest.importorskip("tensorflow_datasets")
  root = str(tmp_path_factory.mktemp("jpegs"))
  name = images.write_jpeg_dataset(root, splits=SPLITS, num_classes=NUM_CLASSES)
  return root, name


def build(root, name, **overrides):
  config = dict(
      name="tfds",
      tfds_name=name,
      data_dir=root,
      preprocess="imagenet",
      image_size=24,
  )
  return datafiles.build(**(config | overrides))


def encode(pixels: np.ndarray) -> bytes:
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, format="PNG")
  return out.getvalue()


def denormalize(x, preprocess):
  return x * np.array(preprocess.std) * 255 + np.array(preprocess.mean) * 255


def test_random_crop_boxes_have_the_asked_area_and_ratio():
  preprocess = images.Preprocess(image_size=8)
  rng = np.random.default_rng(0)
  width, height = 300, 200
  for _ in range(500):
    left, top, right, bottom = images.random_crop_box(
        width, height, preprocess, rng
    )
    w, h = right - left, bottom - top
    assert 0 <= left < right <= width and 0 <= top < bottom <= height
    # Rounding w and h moves the area and ratio by under a pixel's worth.
    assert 0.08 * 0.9 <= w * h / (width * height) <= 1
    assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_random_crop_falls_back_to_a_central_crop_at_the_nearest_ratio():
  # No crop of ratio 3-4 fits a 90% area of a square: the fallback is the
  # central crop of ratio 3, the whole width.
  preprocess = images.Preprocess(
      image_size=8, crop_scale=(0.9, 1.0), crop_ratio=(3.0, 4.0)
  )
  box = images.random_crop_box(60, 60, preprocess, np.random.default_rng(0))
  assert box == (0, 20, 60, 40)


def test_normalize_maps_mean_to_zero_and_one_std_to_one():
  preprocess = images.Preprocess(image_size=8)
  mean = np.array(images.IMAGENET_MEAN) * 255
  std = np.array(images.IMAGENET_STD) * 255
  pixels = np.stack([mean, mean + std]).astype(np.float32)
  # uint8 pixels cannot hold these exactly; normalize takes any dtype.
  out = preprocess.normalize(pixels)
  np.testing.assert_allclose(out, [[0, 0, 0], [1, 1, 1]], atol=1e-5)
  assert out.dtype == np.float32


def test_eval_crop_is_the_center_of_the_resized_image():
  # 80 x 40, red in the middle 32 x 32 square, blue around it; resized to a
  # shorter side of 16 (8 / 0.5), the central 8 x 8 covers the middle 20 x
  # 20 of the original: all red.
  pixels = np.zeros((40, 80, 3), np.uint8)
  pixels[..., 2] = 255
  pixels[4:36, 24:56] = (255, 0, 0)
  preprocess = images.Preprocess(image_size=8, crop_fraction=0.5)
  out = denormalize(images.eval_image(encode(pixels), preprocess), preprocess)
  assert out.shape == (8, 8, 3)
  np.testing.assert_allclose(
      out, np.broadcast_to([255, 0, 0], out.shape), atol=1
  )


def test_train_crops_differ_by_seed_and_repeat_for_the_same_seed():
  rng = np.random.default_rng(0)
  pixels = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
  preprocess = images.Preprocess(image_size=16)
  crop = lambda seed: images.train_image(
      encode(pixels), preprocess, np.random.default_rng(seed)
  )
  np.testing.assert_array_equal(crop(1), crop(1))
  assert not np.array_equal(crop(1), crop(2))
  assert crop(1).shape == (16, 16, 3) and crop(1).dtype == np.float32


def test_grayscale_images_are_read_as_rgb():
  gray = np.full((30, 20), 77, np.uint8)
  preprocess = images.Preprocess(image_size=8, mean=(0, 0, 0), std=(1, 1, 1))
  out = images.eval_image(encode(gray), preprocess)
  np.testing.assert_allclose(out, 77 / 255, atol=1e-6)
  assert out.shape == (8, 8, 3)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"preprocess": "inception"}, "config.data.preprocess must be one of"),
        ({"crop_scale": (0.5, 0.1)}, r"config.data.crop_scale .*\(0.5, 0.1\)"),
        ({"crop_scale": (0.1, 2.0)}, r"config.data.crop_scale must lie in"),
        ({"crop_ratio": 1.0}, r"config.data.crop_ratio must be a pair"),
        ({"crop_fraction": 0.0}, r"config.data.crop_fraction .* got 0.0"),
        ({"mean": (0.5, 0.5)}, r"config.data.mean must hold 3 numbers"),
        ({"std": (1.0, 0.0, 1.0)}, r"config.data.std must be positive"),
        ({"image_size": 0}, r"config.data.image_size must be an int >= 1"),
    ],
)
def test_bad_preprocessing_arguments_name_themselves(
    jpeg_dir, overrides, match
):
  with pytest.raises(ValueError, match=match):
    build(*jpeg_dir, **overrides)


def test_variable_shapes_without_preprocessing_say_how_to_crop(jpeg_dir):
  with pytest.raises(ValueError, match="config.data.preprocess='imagenet'"):
    build(*jpeg_dir, preprocess="none")


def test_tfds_images_of_any_size_give_fixed_crops(jpeg_dir):
  dataset = build(*jpeg_dir)
  assert (len(dataset.train), len(dataset.eval)) == (240, 40)
  assert dataset.input_shape == (24, 24, 3)
  assert dataset.num_classes == NUM_CLASSES
  loader = data.Loader(dataset.train, global_batch=16, seed=3)
  batch = loader.batch(5)
  assert batch["inputs"].shape == (16, 24, 24, 3)
  assert batch["inputs"].dtype == np.float32
  # Normalized pixels: near zero mean, near unit spread, over a few batches.
  pixels = np.concatenate([loader.batch(s)["inputs"] for s in range(4)])
  assert abs(pixels.mean()) < 1.0 and 0.3 < pixels.std() < 3
  np.testing.assert_array_equal(loader.batch(5)["inputs"], batch["inputs"])
  assert not np.array_equal(loader.batch(6)["inputs"], batch["inputs"])
  other_seed = data.Loader(dataset.train, global_batch=16, seed=4).batch(5)
  assert not np.array_equal(other_seed["inputs"], batch["inputs"])
  # Evaluation crops do not change from pass to pass.
  first = next(data.eval_batches(dataset.eval, global_batch=16))
  again = next(data.eval_batches(dataset.eval, global_batch=16))
  np.testing.assert_array_equal(first["inputs"], again["inputs"])


def test_processes_rows_together_are_the_single_process_batch(jpeg_dir):
  """A row's crop follows its stream position, not the process reading it."""
  dataset = build(*jpeg_dir)
  whole = data.Loader(dataset.train, global_batch=8, seed=1).batch(31)
  halves = [
      data.Loader(
          dataset.train,
          global_batch=8,
          seed=1,
          process_index=i,
          process_count=2,
      ).batch(31)
      for i in range(2)
  ]
  for key in whole:
    np.testing.assert_array_equal(
        np.concatenate([h[key] for h in halves]), whole[key]
    )


@pytest.mark.slow
def test_pipeline_batches_are_bitwise_the_same_with_0_1_2_workers(jpeg_dir):
  dataset = build(*jpeg_dir)
  loader = data.Loader(dataset.train, global_batch=8, seed=0)
  # Starting at step 27 as a resumed run would: batches span epoch 0 and 1.
  expected = [loader.batch(step) for step in range(27, 33)]
  for workers in (0, 1, 2):
    with pipeline.batches(
        loader.batch, 27, 33, workers=workers, prefetch=2
    ) as batches:
      got = list(batches)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
      for key in b:
        np.testing.assert_array_equal(a[key], b[key])


def test_pipeline_workers_end_with_the_block_even_on_an_error(
    jpeg_dir, monkeypatch
):
  dataset = build(*jpeg_dir)
  loader = data.Loader(dataset.train, global_batch=8, seed=0)
  collections = []
  monkeypatch.setattr(gc, "collect", lambda: collections.append(1))
  with pytest.raises(RuntimeError, match="stop here"):
    with pipeline.batches(loader.batch, 0, 100, workers=2, prefetch=2) as it:
      next(it)
      assert multiprocessing.active_children()
      raise RuntimeError("stop here")
  assert not multiprocessing.active_children()
  assert next(it, None) is None  # closed, it holds no batch
  # What the workers left in shared memory is collected at the close.
  assert collections == [1]


def test_a_pipeline_without_workers_closes_without_a_collection(monkeypatch):
  """A full garbage collection costs a training loop a pause; only batches
  from worker processes, in shared memory, need one at the close."""
  collections = []
  monkeypatch.setattr(gc, "collect", lambda: collections.append(1))
  read = lambda i: {"x": np.full((2,), i)}
  with pipeline.batches(read, 3, 6, workers=0, prefetch=1) as it:
    assert [int(b["x"][0]) for b in it] == [3, 4, 5]
  assert not collections


def test_processes_started_with_the_trainers_signals_held_inherit_them():
  """Grain starts its threads and workers on the first batch; a worker that
  Ctrl-C reached while it imported printed its own KeyboardInterrupt. So
  they start with SIGINT and SIGHUP held, and the caller's mask is back
  after."""
  before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
  code = (
      "import signal\n"
      "print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
  )
  with pipeline._signals_held():
    held = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
  assert held.stdout.strip() == str(sorted([signal.SIGHUP, signal.SIGINT]))
  assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


@pytest.mark.parametrize(
    "workers, prefetch, match",
    [
        (-1, 2, "config.data_workers must be a non-negative int, got -1"),
        (1, 0, "config.data_workers=1 needs config.data_prefetch >= 1"),
        (0, 1.5, "config.data_prefetch must be a non-negative int, got 1.5"),
    ],
)
def test_bad_pipeline_arguments_name_themselves(workers, prefetch, match):
  with pytest.raises(ValueError, match=match):
    pipeline.check(workers, prefetch)


def resnet18_config(root, name, steps, workers):
  """ResNet-50's ImageNet config, pointed at the small JPEGs, on ResNet-18."""
  config = resnet50_imagenet.get_config()
  config.data.tfds_name = name
  config.data.data_dir = root
  config.data.eval_split = "test"
  config.data.image_size = 32
  config.data.num_classes = NUM_CLASSES
  config.data_workers = workers
  config.model.name = "resnet18"
  config.per_device_batch_size = 2
  config.num_train_steps = steps
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.schedule = {"name": "constant", "warmup_steps": 0}
  config.optimizer.learning_rate = 0.01
  return config


@pytest.mark.slow
def test_resnet18_trains_and_resumes_bitwise_on_variable_size_images(
    jpeg_dir, tmp_path
):
  """Four steps with 2 workers (random crops), held-out loss on central
  crops; then 2 steps and a resume to 4 with 0 workers: the same params."""
  root, name = jpeg_dir
  whole = train.train_and_evaluate(
      resnet18_config(root, name, 4, workers=2), str(tmp_path / "whole")
  )
  assert whole["step"] == 4
  assert math.isfinite(whole["loss"]) and math.isfinite(whole["eval_loss"])
  assert 0 <= whole["eval_accuracy"] <= 1
  workdir = str(tmp_path / "resumed")
  train.train_and_evaluate(resnet18_config(root, name, 2, workers=0), workdir)
  resumed = train.train_and_evaluate(
      resnet18_config(root, name, 4, workers=1), workdir
  )
  assert resumed["params_sha256"] == whole["params_sha256"]
  assert resumed["eval_loss"] == whole["eval_loss"]
