"""The models the benchmarks measure, each built from its training config.

A workload is a config of ``configs/`` with the overrides that make it need
no download (synthetic inputs of the same shapes), so the benchmarks measure
exactly the parameter trees and compressor settings that training uses: the
paper's ranks (4 for the ResNets, 32 for BERT) and Top-k's density come from
the configs.
"""

import dataclasses
import functools
import importlib
from typing import Any

import jax
import ml_collections

import acp_jax
from acp_jax import collectives
from acp_jax import lowrank
from acp_jax import registry
from train import experiment as experiment_lib
from train import optimizers

COMPRESSORS = registry.names()


@dataclasses.dataclass(frozen=True)
class Workload:
  config: str  # module under configs/
  overrides: tuple[tuple[str, Any], ...] = ()
  paper: bool = False  # one of the paper's four models


_SYNTHETIC_IMAGES = (
    ("data.name", "synthetic_images"),
    ("data.num_examples", 8),
)

WORKLOADS = {
    "resnet50": Workload("resnet50_imagenet", _SYNTHETIC_IMAGES, paper=True),
    "resnet152": Workload("resnet152_imagenet", _SYNTHETIC_IMAGES, paper=True),
    "bert_base": Workload("bert_base", (("data.num_examples", 8),), paper=True),
    "bert_large": Workload(
        "bert_large", (("data.num_examples", 8),), paper=True
    ),
    "resnet18_cifar": Workload("cifar10_resnet18", _SYNTHETIC_IMAGES),
    "char_lm": Workload(
        "tinyshakespeare",
        (
            (
                "data",
                {
                    "name": "synthetic_tokens",
                    "seq_len": 128,
                    "vocab_size": 65,
                    "task": "causal_lm",
                    "num_examples": 8,
                },
            ),
        ),
    ),
    "small_cnn": Workload("default"),
}
PAPER = tuple(name for name, w in WORKLOADS.items() if w.paper)
SMALL = tuple(name for name, w in WORKLOADS.items() if not w.paper)


def load_config(
    module: str, overrides: tuple[tuple[str, Any], ...] = ()
) -> ml_collections.ConfigDict:
  """``configs/<module>.py``'s config with ``(dotted key, value)`` overrides;
  a dict value replaces a whole section."""
  cfg = importlib.import_module(f"configs.{module}").get_config()
  for key, value in overrides:
    section, _, field = key.rpartition(".")
    if isinstance(value, dict):
      value = ml_collections.ConfigDict(value)
    setattr(cfg[section] if section else cfg, field, value)
  return cfg


def _compressing(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``cfg`` without its dense warm-up: the benchmarks measure the steps
  that compress."""
  for low_rank in registry.low_rank():
    cfg.compressor[low_rank].warmup_steps = 0
  return cfg


def config(
    name: str, compressor: str | None = None
) -> ml_collections.ConfigDict:
  """The training config of workload ``name``, with ``compressor`` if given."""
  if name not in WORKLOADS:
    raise ValueError(
        f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}"
    )
  workload = WORKLOADS[name]
  cfg = _compressing(load_config(workload.config, workload.overrides))
  if compressor is not None:
    cfg.compressor.name = compressor
  return cfg


@functools.cache
def experiment(name: str) -> experiment_lib.Experiment:
  """The workload built abstractly (no parameter is allocated)."""
  return experiment_lib.build(config(name))


def compressor(name: str, compressor_name: str) -> acp_jax.Compressor:
  """``compressor_name`` with the arguments the workload's config gives it."""
  if compressor_name not in COMPRESSORS:
    raise ValueError(
        f"unknown compressor {compressor_name!r}; choose from"
        f" {', '.join(COMPRESSORS)}"
    )
  return optimizers.compressor(
      config(name, compressor_name), experiment_lib.AXIS
  )


def describe(name: str) -> dict[str, Any]:
  """Parameters, low-rank plan and settings of workload ``name``."""
  cfg = config(name)
  params = experiment(name).abstract_params
  low_rank = cfg.compressor.acp_sgd
  plan = lowrank.settings(
      "benchmarks",
      low_rank.rank,
      lowrank.Options(min_compression_rate=low_rank.min_compression_rate),
  ).plan(params)
  leaves = jax.tree.leaves(params)
  return {
      "model": name,
      "params": sum(x.size for x in leaves),
      "leaves": len(leaves),
      "compressed_matrices": sum(spec is not None for spec in plan),
      "dense_bytes": collectives.dense_nbytes(
          [x for x, spec in zip(leaves, plan) if spec is None]
      ),
      "rank": low_rank.rank,
      "density": cfg.compressor.topk_sgd.density,
  }


# Cluster workloads: BERT's encoder as configs/bert_base.py trains it, made
# small enough in compute that the links decide the step time here.
CLUSTER_MODELS = {
    # BERT-Base's matrices (hidden 768, 12 heads, FFN 3072) in 2 of its 12
    # layers, an 8,192-token vocabulary and 2 sequences of 16 tokens per
    # worker: 21.3 M parameters, 85 MB of gradients per step, which a
    # 1 Gb/s link takes about a second to all-reduce.
    "bert_base_2l": {
        "size": {"num_layers": 2, "hidden": 768, "heads": 12, "ffn": 3072},
        "vocab_size": 8192,
        "seq_len": 16,
        "batch_size": 2,
        "rank": 4,
    },
    # For the smoke test.
    "tiny": {
        "size": {"num_layers": 1, "hidden": 64, "heads": 4, "ffn": 128},
        "vocab_size": 512,
        "seq_len": 16,
        "batch_size": 4,
        "rank": 4,
    },
}


def cluster_config(
    model: str, compressor: str, steps: int
) -> ml_collections.ConfigDict:
  """The training config of cluster workload ``model``."""
  if model not in CLUSTER_MODELS:
    raise ValueError(
        f"unknown cluster model {model!r}; choose from"
        f" {', '.join(CLUSTER_MODELS)}"
    )
  m = CLUSTER_MODELS[model]
  cfg = load_config(
      "bert_base",
      (
          ("model", {"name": "bert", "size": m["size"]}),
          (
              "data",
              {
                  "name": "synthetic_tokens",
                  "seq_len": m["seq_len"],
                  "vocab_size": m["vocab_size"],
                  "task": "masked_lm",
                  "num_examples": 64,
              },
          ),
          ("per_device_batch_size", m["batch_size"]),
          ("compressor.name", compressor),
          *((f"compressor.{n}.rank", m["rank"]) for n in registry.low_rank()),
          ("num_train_steps", steps),
          ("log_every_steps", steps),
          ("eval_every_steps", 0),
          ("checkpoint_every_steps", 0),
      ),
  )
  return _compressing(cfg)
