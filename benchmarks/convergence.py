"""The five compressors trained side by side: same seed, data order,
schedule and step budget, on 8 simulated devices.

Tasks: the MNIST test set (split 8,000 / 2,000) on the small CNN, and
tiny-shakespeare on the character LM. Each run is the real train loop
(``train.train_and_evaluate``) in a temporary workdir; its ``metrics.jsonl``
gives the curves.
"""

import json
import os
import pathlib
import tempfile
import time
from typing import Any

import ml_collections

from benchmarks import workloads
from train import train

# task -> (config, overrides). The char LM runs at half the config's batch
# and sequence length: its 1,000 steps of 64 x 128 characters take 20
# minutes per compressor on 2 cores, these 500 steps of 32 x 64 three.
TASKS = {
    "mnist": (
        "mnist",
        (("num_train_steps", 500), ("eval_every_steps", 50)),
    ),
    "char_lm": (
        "tinyshakespeare",
        (
            ("num_train_steps", 500),
            ("eval_every_steps", 100),
            ("batch_size", 32),
            ("data.seq_len", 64),
            ("model.max_len", 64),
        ),
    ),
}
# Quick runs shrink the budget and the models: a smoke test.
QUICK_STEPS = 24


def config(
    task: str, compressor: str, data_path: str, quick: bool
) -> ml_collections.ConfigDict:
  """The training config of ``task`` with ``compressor``.

  Raises:
    FileNotFoundError: if ``data_path`` does not exist.
  """
  if not os.path.exists(data_path):
    raise FileNotFoundError(
        f"{task}: data path {data_path!r} does not exist; pass it with"
        f" --{task}_path"
    )
  cfg = workloads.load_config(*TASKS[task])
  cfg.compressor.name = compressor
  cfg.data.path = data_path
  cfg.log_every_steps = 10
  if quick:
    cfg.num_train_steps = QUICK_STEPS
    cfg.eval_every_steps = QUICK_STEPS // 2
    cfg.log_every_steps = 4
    cfg.schedule.warmup_steps = 4
    if task == "mnist":
      cfg.model.width = 8
      cfg.data.eval_examples = 200
    else:
      cfg.model.update(dim=32, num_layers=1, num_heads=2)
  # One checkpoint, at the end: the benchmark measures training, not saving.
  cfg.checkpoint_every_steps = 0
  return cfg


def _curve(workdir: str) -> list[dict[str, Any]]:
  """``metrics.jsonl`` lines, train and eval lines of a step merged."""
  by_step: dict[int, dict[str, Any]] = {}
  for line in pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    by_step.setdefault(record["step"], {}).update(record)
  return [by_step[s] for s in sorted(by_step)]


def run(task: str, compressor: str, data_path: str, quick: bool):
  """Trains one compressor on ``task``; its final record and curve."""
  cfg = config(task, compressor, data_path, quick)
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    summary = train.train_and_evaluate(cfg, workdir)
    seconds = time.perf_counter() - start
    lines = _curve(workdir)
  phases = summary["bytes_per_phase"]
  sent = lambda step: sum(phases[t % len(phases)] for t in range(step))
  curve = [
      {
          "task": task,
          "compressor": compressor,
          "step": line["step"],
          "bytes_sent": sent(line["step"]),
          "loss": line.get("loss"),
          "eval_loss": line.get("eval_loss"),
          "eval_accuracy": line.get("eval_accuracy"),
      }
      for line in lines
  ]
  final = {
      "task": task,
      "compressor": compressor,
      "model": cfg.model.name,
      "steps": summary["step"],
      "global_batch": cfg.batch_size,
      "num_devices": summary["num_devices"],
      "eval_loss": summary["eval_loss"],
      "eval_accuracy": summary["eval_accuracy"],
      "loss": summary["loss"],
      "bytes_per_step": summary["bytes_per_step"],
      "bytes_sent": sent(summary["step"]),
      "wall_seconds": seconds,
  }
  return final, curve


def measure(
    paths: dict[str, str], quick: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Final records and curve points for every task and compressor."""
  for task, path in paths.items():
    config(task, "ssgd", path, quick)  # a missing file fails before training
  finals, curves = [], []
  for task, path in paths.items():
    rows = {}
    for name in workloads.COMPRESSORS:
      rows[name], curve = run(task, name, path, quick)
      curves.extend(curve)
    base = rows["ssgd"]
    for row in rows.values():
      # Accuracy in points; loss relative, as the targets put them.
      row["accuracy_vs_ssgd_pts"] = 100 * (
          row["eval_accuracy"] - base["eval_accuracy"]
      )
      row["loss_vs_ssgd_pct"] = 100 * (row["eval_loss"] / base["eval_loss"] - 1)
    acp = rows["acp_sgd"]
    acp["meets_target"] = (
        acp["accuracy_vs_ssgd_pts"] >= -1.0
        if task == "mnist"
        else acp["loss_vs_ssgd_pct"] <= 3.0
    )
    finals.extend(rows.values())
  return finals, curves


COLUMNS = {
    "task": "task",
    "compressor": "compressor",
    "steps": "steps",
    "global_batch": "batch",
    "eval_accuracy": "held-out accuracy",
    "eval_loss": "held-out loss",
    "accuracy_vs_ssgd_pts": "acc. vs S-SGD (pts)",
    "loss_vs_ssgd_pct": "loss vs S-SGD (%)",
    "bytes_per_step": "bytes/step",
    "bytes_sent": "bytes sent",
    "wall_seconds": "seconds",
}
