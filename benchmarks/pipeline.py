"""How fast the input pipeline makes ImageNet-style batches, beside how fast
the train step consumes them.

A small TFDS data set of JPEGs with sides of 20 to 80 pixels (the tests'
kind, written by ``train.images.write_jpeg_dataset``) is read through
``train.pipeline`` with 0, 1 and 2 worker processes: each batch decoded,
random-resized cropped, flipped and normalized. Its rate is images per second
after the first batch arrives (the workers' start-up is reported apart).
The train step is ResNet-18 on the same crops, data-parallel over the
simulated devices, fed one fixed batch, timed after its compilation.

  python -m benchmarks pipeline [--quick]
"""

import tempfile
import time
from typing import Any

import ml_collections
import numpy as np

from benchmarks import cli

IMAGE_SIZE = 64
GLOBAL_BATCH = 32
WORKERS = (0, 1, 2)
NUM_CLASSES = 10
COLUMNS = {
    "kind": "what",
    "workers": "workers",
    "images_per_sec": "images/s",
    "startup_s": "start-up s",
    "batches": "batches",
}


def _config(data_dir: str, name: str) -> ml_collections.ConfigDict:
  from configs import resnet50_imagenet

  config = resnet50_imagenet.get_config()
  config.data.tfds_name = name
  config.data.data_dir = data_dir
  config.data.eval_split = "test"
  config.data.image_size = IMAGE_SIZE
  config.model.name = "resnet18"
  config.per_device_batch_size = 0
  config.batch_size = GLOBAL_BATCH
  return config


def _pipeline_rate(loader, workers: int, batches: int) -> dict[str, Any]:
  from train import pipeline

  begin = time.perf_counter()
  with pipeline.batches(
      loader.batch, 0, batches + 1, workers=workers, prefetch=2
  ) as it:
    next(it)
    first = time.perf_counter()
    for _ in it:
      pass
    end = time.perf_counter()
  return {
      "kind": "pipeline",
      "workers": workers,
      "images_per_sec": batches * GLOBAL_BATCH / (end - first),
      "startup_s": first - begin,
      "batches": batches,
  }


def _step_rate(config, steps: int) -> dict[str, Any]:
  import jax

  from train import data as data_lib
  from train import experiment as experiment_lib
  from train import train

  experiment = experiment_lib.build(config)
  train_fn, _ = train.compile_steps(experiment)
  state = experiment_lib.init_state(experiment)
  loader = data_lib.Loader(
      experiment.dataset.train, global_batch=GLOBAL_BATCH, seed=0
  )
  batch = experiment_lib.put_batch(experiment, loader.batch(0))
  begin = time.perf_counter()
  state, _ = jax.block_until_ready(train_fn(state, batch))
  compiled = time.perf_counter()
  durations = []
  for _ in range(steps):
    start = time.perf_counter()
    # One step at a time: XLA:CPU's simulated devices can deadlock with
    # several in flight.
    state, _ = jax.block_until_ready(train_fn(state, batch))
    durations.append(time.perf_counter() - start)
  return {
      "kind": f"train step ({config.model.name}, {jax.device_count()} devices)",
      "workers": None,
      "images_per_sec": GLOBAL_BATCH / float(np.median(durations)),
      "startup_s": compiled - begin,
      "batches": steps,
  }


def measure(quick: bool) -> list[dict[str, Any]]:
  """The pipeline's rate at 0, 1 and 2 workers, then the train step's."""
  from train import data as data_lib
  from train import images

  batches = 20 if quick else 100
  rows = []
  with tempfile.TemporaryDirectory() as data_dir:
    name = images.write_jpeg_dataset(
        data_dir,
        splits={"train": 480, "test": 64},
        num_classes=NUM_CLASSES,
    )
    config = _config(data_dir, name)
    dataset = data_lib.build(config.data)
    loader = data_lib.Loader(dataset.train, global_batch=GLOBAL_BATCH, seed=0)
    for workers in WORKERS:
      rows.append(_pipeline_rate(loader, workers, batches))
      print(
          f"pipeline: {workers} workers, {rows[-1]['images_per_sec']:.0f}"
          " images/s"
      )
    rows.append(_step_rate(config, 3 if quick else 10))
  return [
      {**r, "image_size": IMAGE_SIZE, "global_batch": GLOBAL_BATCH}
      for r in rows
  ]


HELP = (
    "images/s of the input pipeline at 0-2 workers, beside the train step's"
)


def add_arguments(parser) -> None:
  cli.add_quick(parser)


def main(args) -> None:
  meta = cli.start(args, args.num_cpu_devices)
  rows = measure(args.quick)
  cli.finish(args, meta, {"pipeline": rows}, rows, COLUMNS)
