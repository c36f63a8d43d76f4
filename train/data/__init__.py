"""Host-side data: named loaders, deterministic training batches, eval passes.

Every batch is a dict of NumPy arrays:

* ``inputs``: float32 [B, H, W, C] images, or int32 [B, L] token ids;
* ``targets``: int32 [B] labels, or int32 [B, L] token ids;
* ``weights``: float32 [B] or [B, L]; losses and accuracies are weighted
  means, so padding rows (weight 0) and unmasked tokens do not count.

``build(config.data)`` picks a loader by ``config.data.name`` and returns a
``Dataset`` of two random-access ``Source`` splits. ``Loader.batch(step)`` is a
pure function of (seed, step), so a resumed run continues from the step number
alone; ``eval_batches`` walks a split once, in order.

Modules: ``sources`` (the splits), ``loaders`` and ``tfds`` (a dataclass per
loader, its fields the loader's arguments), ``idx`` (MNIST's file format),
``arguments`` (the checks those fields declare), ``batching`` (training
batches and evaluation passes).
"""

import ml_collections

from train.data import arguments
from train.data.batching import eval_batch
from train.data.batching import eval_batches
from train.data.batching import Loader
from train.data.batching import num_eval_batches
from train.data.idx import read_idx
from train.data.idx import read_mnist
from train.data.loaders import Digits
from train.data.loaders import MaskedText
from train.data.loaders import Mnist
from train.data.loaders import SyntheticImages
from train.data.loaders import SyntheticTokens
from train.data.loaders import Text
from train.data.sources import ArraySource
from train.data.sources import Dataset
from train.data.sources import ImageSource
from train.data.sources import MASK_ID
from train.data.sources import MASK_RATE
from train.data.sources import MaskedTextSource
from train.data.sources import Source
from train.data.sources import TASKS
from train.data.sources import TextSource
from train.data.sources import TfdsImageSource
from train.data.sources import TfdsSource
from train.data.tfds import PREPROCESS
from train.data.tfds import Tfds

# config.data.name -> the loader's dataclass, its fields its arguments.
LOADERS: dict[str, type] = {
    "digits": Digits,
    "mnist": Mnist,
    "text": Text,
    "tfds": Tfds,
    "masked_text": MaskedText,
    "synthetic_images": SyntheticImages,
    "synthetic_tokens": SyntheticTokens,
}
# loader -> where its data comes from, for the error when a config's path is
# left empty: the data sets are not part of the repository.
DATA_SOURCES = {
    "mnist": (
        "a folder of MNIST's IDX files (e.g. t10k-images-idx3-ubyte.gz and"
        " t10k-labels-idx1-ubyte.gz from https://yann.lecun.com/exdb/mnist/"
        " or a mirror such as https://ossci-datasets.s3.amazonaws.com/mnist/)"
    ),
    "text": (
        "a UTF-8 text file, e.g. tiny-shakespeare's input.txt from"
        " https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
        "tinyshakespeare/input.txt"
    ),
}
DATA_SOURCES["masked_text"] = DATA_SOURCES["text"]


def build(config: ml_collections.ConfigDict) -> Dataset:
  """The data set ``config.name`` made with the arguments beside the name.

  Names, arguments and paths are checked before anything is read.

  Args:
    config: ``config.data`` of a training config, e.g. ``{"name": "mnist",
      "path": "/data/mnist"}``; missing optional arguments take the defaults
      of the loader's dataclass in ``LOADERS``.

  Returns:
    The ``Dataset``.

  Raises:
    ValueError: for an unknown loader name, an argument no loader takes, a
      missing required argument, or a bad value.
    FileNotFoundError: when a path argument does not exist.
  """
  args = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  name = args.pop("name", None)
  if name not in LOADERS:
    raise ValueError(
        f"config.data.name={name!r} is not a loader; choose one of"
        f" {', '.join(LOADERS)}"
    )
  every = arguments.names(LOADERS.values())
  unknown = sorted(set(args) - every)
  if unknown:
    raise ValueError(
        f"unknown argument(s) {', '.join(f'config.data.{k}' for k in unknown)}"
        f"; loaders take: {', '.join(sorted(every))}"
    )
  loader = LOADERS[name]
  kwargs = arguments.check(name, loader, args, DATA_SOURCES.get(name))
  return loader(**kwargs).load()
