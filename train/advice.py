"""``config.compressor.name = "auto"``: the trainer asks ``acp_jax.advise``.

At a fresh start the advice is read from ``config.compressor.auto.advice``
(a file that ``python -m benchmarks advise --json`` or an earlier run wrote)
or measured on this config's model, batches and the link of
``config.compressor.auto``; its table is logged and it is saved in the
workdir (``ADVICE_FILE``). The run then trains with the pick, as if the
config had named it: the compressor's name and arguments in every
checkpoint's record are the pick's, and the advice's reasons are saved
beside them (``settings``).

A resume reuses the advice saved in the workdir and measures nothing, so it
cannot pick another compressor on a noisier measurement. A resume given
another advice file whose pick differs is refused, naming both picks; a
workdir whose saved advice was removed is advised afresh, and a checkpoint
of another pick is then refused by its record.
"""

import json
import os
import sys
from typing import Any

from flax import nnx
import jax
import ml_collections
import numpy as np

from acp_jax_tools import advice as advice_lib
from acp_jax_tools import steps as steps_lib
from train import checks
from train import config as config_lib
from train import experiment as experiment_lib
from train import loss as loss_lib
from train import optimizers

AUTO = "auto"
# The advice a run trains with, in its workdir.
ADVICE_FILE = "advice.json"


# The held-out batches a short run's losses are taken on.
EVAL_BATCHES = 4


def inputs(
    config: ml_collections.ConfigDict,
    workers: int,
    steps: int,
    run_steps: int = 0,
    run_repeats: int = 1,
):
  """``config``'s per-worker loss, initial params and first ``steps``
  global batches (its global batch on ``workers`` devices): what
  ``acp_jax.advise`` measures on; and, for ``run_steps``, its
  ``ShortRuns`` (None for 0): the config's base optimizer (the one after
  the compressor), ``run_steps`` batches in an order shuffled by the
  config's seed, ``EVAL_BATCHES`` of the held-out split, and
  ``run_repeats``."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.compressor.name = "ssgd"
  experiment = experiment_lib.build(config)
  graphdef, params, batch_stats = jax.jit(
      lambda: nnx.split(experiment.create_model(), nnx.Param, nnx.BatchStat)
  )()
  params = nnx.to_pure_dict(params)
  batch_stats = nnx.to_pure_dict(batch_stats)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params, batch_stats)
    logits = model(
        batch["inputs"], train=True, rngs=nnx.Rngs(dropout=jax.random.key(0))
    )
    return loss_lib.mean_loss(logits, batch)

  # The same rows in every process (a Loader would split them): the
  # workers are simulated here.
  global_batch = config_lib.global_batch_size(config, workers)
  data = experiment.dataset

  def batches(split, order, count):
    rows = np.arange(count * global_batch).reshape(count, global_batch)
    return [split.get(order[r % len(order)]) for r in rows]

  first = batches(data.train, np.arange(len(data.train)), steps)
  if not run_steps:
    return loss_fn, params, first, None
  shuffled = np.random.default_rng(config.seed).permutation(len(data.train))
  run = steps_lib.ShortRuns(
      optimizers.optimizer(config, optimizers.schedule(config)),
      batches(data.train, shuffled, run_steps),
      batches(data.eval, np.arange(len(data.eval)), EVAL_BATCHES),
      run_repeats,
  )
  return loss_fn, params, first, run


def _workers(config: ml_collections.ConfigDict) -> int:
  return config.compressor.auto.workers or jax.device_count()


def _measured(config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """The advice measured on ``config``'s model and ``auto``'s link."""
  auto = config.compressor.auto
  if auto.bandwidth is None:
    raise checks.ConfigError(
        "config.compressor.name='auto' needs config.compressor.auto.bandwidth"
        " (bytes per second; inf for none) or config.compressor.auto.advice"
        " (a saved advice file), got neither"
    )
  loss_fn, params, batches, short_runs = inputs(
      config, _workers(config), auto.steps, auto.run_steps, auto.run_repeats
  )
  advice = advice_lib.advise(
      loss_fn,
      params,
      batches,
      workers=_workers(config),
      link=advice_lib.Link(auto.bandwidth, auto.latency),
      max_gap=auto.max_gap,
      short_runs=short_runs,
      progress=lambda line: print(f"advice: {line}", file=sys.stderr),
  )
  print(advice.table(), flush=True)
  return advice.to_record()


def _read(path: str, workers: int) -> list[dict[str, Any]]:
  """The rows of the advice for ``workers`` in the file at ``path``."""
  with open(path) as f:
    rows = [r for r in json.load(f) if r["workers"] == workers]
  if not any(r["picked"] for r in rows):
    raise ValueError(
        f"config.compressor.auto.advice={path!r} holds no advice for"
        f" {workers} workers (config.compressor.auto.workers, 0: the"
        " devices)"
    )
  return rows


def _pick(rows: list[dict[str, Any]]) -> dict[str, Any]:
  return next(r for r in rows if r["picked"])


def _advice(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The picked row of the advice this run trains with: the workdir's,
  else the config's file, else a fresh measurement; saved in the
  workdir."""
  workers = _workers(config)
  saved_path = os.path.join(workdir, ADVICE_FILE)
  given_path = config.compressor.auto.advice
  given = _read(given_path, workers) if given_path else None
  if os.path.exists(saved_path):
    saved_rows = _read(saved_path, workers)
    print(advice_lib.table(saved_rows), flush=True)
    saved = _pick(saved_rows)
    if given is not None and _pick(given)["name"] != saved["name"]:
      raise ValueError(
          f"config.compressor.auto.advice={given_path!r} picks"
          f" {_pick(given)['name']}, but this workdir's run trains with"
          f" {saved['name']} ({saved_path}): a resume keeps its compressor."
          " Drop the advice file to resume, or use another workdir"
      )
    print(f"advice: resuming with {saved['name']} ({saved_path})")
    return saved
  rows = given if given is not None else _measured(config)
  if given is not None:
    print(advice_lib.table(given), flush=True)
  os.makedirs(workdir, exist_ok=True)
  with open(saved_path, "w") as f:
    json.dump(rows, f, indent=1)
  print(f"advice: training with {_pick(rows)['name']} ({saved_path})")
  return _pick(rows)


def _check_numbers(auto: ml_collections.ConfigDict) -> None:
  """Raises ``checks.ConfigError`` naming an ``auto`` number out of range."""
  try:
    if auto.bandwidth is not None and not (
        isinstance(auto.bandwidth, (int, float))
        and not isinstance(auto.bandwidth, bool)
        and auto.bandwidth > 0  # NaN is not
    ):
      raise ValueError(
          "config.compressor.auto.bandwidth must be a number of bytes per"
          f" second in (0, inf], got {auto.bandwidth!r}"
      )
    checks.number("config.compressor.auto.latency", auto.latency, 0.0)
    checks.integer("config.compressor.auto.workers", auto.workers, 0)
    checks.int_in(
        "config.compressor.auto.steps", auto.steps, advice_lib.WARMUP + 1
    )
    checks.int_in("config.compressor.auto.run_repeats", auto.run_repeats, 1)
    low = steps_lib.RUN_STEPS_MIN
    if auto.run_steps != 0 and not (
        checks.is_int(auto.run_steps) and auto.run_steps >= low
    ):
      raise ValueError(
          "config.compressor.auto.run_steps must be 0 (no short run) or an"
          f" int >= {low}, got {auto.run_steps!r}"
      )
    checks.number(
        "config.compressor.auto.max_gap", auto.max_gap, 0.0, low_open=True
    )
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None


def resolve(
    config: ml_collections.ConfigDict, workdir: str
) -> ml_collections.ConfigDict:
  """``config`` as it is, or, for ``compressor.name = "auto"``, a copy that
  names the advised compressor and records the advice in
  ``compressor.auto.picked`` (see ``settings``)."""
  if config.compressor.name != AUTO:
    return config
  _check_numbers(config.compressor.auto)
  pick = _advice(config, workdir)
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.compressor.name = pick["method"]
  if pick["rank"] is not None:
    resolved.compressor[pick["method"]].rank = pick["rank"]
    resolved.compressor[pick["method"]].comm_dtype = pick["comm_dtype"]
  reasons = {
      k: pick[k]
      for k in (
          "name",
          "workers",
          "bandwidth",  # bytes/s; None: infinite
          "latency",
          "step_s",
          "error_to_noise",
          "cosine",
          "threshold",
          "calibration",
      )
  }
  resolved.compressor.auto.picked = json.dumps(reasons)
  return resolved


def settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The advice a resolved ``auto`` config trains with, for the
  checkpoints' records; {} for a config that named its compressor."""
  picked = config.compressor.get(AUTO, {}).get("picked")
  return {"advice": json.loads(picked)} if picked else {}
