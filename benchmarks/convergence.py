"""The compressors trained side by side: same data, schedule and step budget,
on 8 simulated devices, several seeds each.

Tasks: the MNIST test set (split 8,000 / 2,000) on the small CNN, and
tiny-shakespeare on the character LM and on a small BERT's masked LM. Each
run is the real train loop
(``train.train_and_evaluate``) in a temporary workdir; its ``metrics.jsonl``
gives the curves.

Two comparisons are fair to a low-rank method: at equal rank (every
compressor with its config's rank r) and at equal bytes (ACP-SGD at rank
2r sends per step what Power-SGD sends at rank r). Each runs with and
without a dense warm-up. A seed changes the model's initialization and the
data order; the compressors' own seeds stay fixed.
"""

import json
import os
import tempfile
import time
from typing import Any, NamedTuple

import ml_collections

from acp_jax import registry
from benchmarks import cli
from benchmarks import convergence_summary
from benchmarks import workloads
from train import data
from train import metrics as metrics_lib
from train import train

# Momentum SGD on the char LM, from the AdamW config: the learning rate
# that did best of 0.1, 0.3 and 1.0 at 300 steps.
SGD = (("optimizer.name", "sgd"), ("optimizer.learning_rate", 0.1))
# task -> (config, overrides). The char LM runs at half the config's batch
# and sequence length, and at 300 steps but for the long AdamW task: 9
# variants x 3 seeds of a task must fit in about an hour on 2 cores (a
# 300-step run takes about 75 s for MNIST and 110 s for the char LM there).
STEPS = 300
LONG_STEPS = 1000
# MNIST's long task: S-SGD past 0.98 held-out accuracy, where a
# compressor's gap is the one left at convergence.
MNIST_LONG_STEPS = 2000
CHAR_LM = (
    ("eval_every_steps", 50),
    ("batch_size", 32),
    ("data.seq_len", 64),
    ("model.max_len", 64),
)
TASKS = {
    "mnist": (
        "mnist",
        (("num_train_steps", STEPS), ("eval_every_steps", 50)),
    ),
    "char_lm": ("tinyshakespeare", (("num_train_steps", STEPS), *CHAR_LM)),
    "char_lm_sgd": (
        "tinyshakespeare",
        (("num_train_steps", STEPS), *CHAR_LM, *SGD),
    ),
    # Long enough for a low-rank method's gap to reach its plateau.
    "char_lm_long": (
        "tinyshakespeare",
        (("num_train_steps", LONG_STEPS), *CHAR_LM, ("eval_every_steps", 100)),
    ),
    "mnist_long": (
        "mnist",
        (("num_train_steps", MNIST_LONG_STEPS), ("eval_every_steps", 200)),
    ),
    # A second AdamW model: the small BERT's masked LM on the same text, at
    # half its config's batch and sequence length, as the char LM (1000
    # steps at the config's take over an hour on 2 cores), and at its
    # learning-rate warm-up (200 steps). Rank 8 (width / 32, as the char
    # LM's 4 of 128): at the config's 32, ACP-SGD's 2r would leave the
    # 256 x 256 matrices dense.
    "bert_mlm": (
        "bert_shakespeare",
        (
            ("num_train_steps", LONG_STEPS),
            ("eval_every_steps", 100),
            ("batch_size", 32),
            ("data.seq_len", 64),
            ("model.max_len", 64),
            ("compressor.power_sgd.rank", 8),
            ("compressor.acp_sgd.rank", 8),
        ),
    ),
}
LONG_TASKS = ("char_lm_long", "mnist_long")
# Dense steps before compression in the warm-up variants: just past the
# char LM's learning-rate warm-up (50 steps; the CNN's is 20), a fifth of
# their 300-step budget. On the BERT task, whose rate climbs for 200 steps,
# the low-rank variants compress from 30 % of the peak rate on (its config
# would give them 240 dense steps): their gaps to S-SGD include the rest of
# the climb, for Power-SGD and ACP-SGD alike.
WARMUP_STEPS = 60


class Variant(NamedTuple):
  """A compressor as a convergence run uses it."""

  compressor: str
  rank_factor: int | None  # times the config's rank; None: no rank
  warmup: int  # dense steps first
  warm_factors: bool  # factors warmed on the mean gradient then
  # The factors' comm_dtype; None: the gradients' (float32).
  comm_dtype: str | None = None


def _warm(compressor, rank_factor, **kwargs):
  """``compressor`` after WARMUP_STEPS dense steps, its factors warmed."""
  return Variant(compressor, rank_factor, WARMUP_STEPS, True, **kwargs)


VARIANTS = {
    # Each compressor as the config gives it, at the config's rank.
    **{
        n: Variant(n, 1 if registry.get(n).low_rank else None, 0, False)
        for n in registry.names()
    },
    "acp_sgd_2r": Variant("acp_sgd", 2, 0, False),
    "power_sgd_warm": _warm("power_sgd", 1),
    "acp_sgd_warm": _warm("acp_sgd", 1),
    "acp_sgd_2r_warm": _warm("acp_sgd", 2),
    # The same warm-up without warming the factors: the stall it leaves.
    "acp_sgd_warm_cold": Variant("acp_sgd", 1, WARMUP_STEPS, False),
    # Twice the rank in half the bytes per float: each sends what it sends
    # at half that rank in float32 (Power-SGD at 2r, ACP-SGD at 4r: both
    # Power-SGD rank r's bytes); error feedback keeps the rounding.
    "power_sgd_2r_bf16_warm": _warm("power_sgd", 2, comm_dtype="bfloat16"),
    "acp_sgd_4r_bf16_warm": _warm("acp_sgd", 4, comm_dtype="bfloat16"),
    # Where rank 4r leaves matrices dense (the small CNN), ACP-SGD's
    # bfloat16 factors at 2r: between its rank-r and 2r bytes in float32.
    "acp_sgd_2r_bf16_warm": _warm("acp_sgd", 2, comm_dtype="bfloat16"),
}
# Which variants each task runs, and with how many seeds: Sign-SGD and Top-k
# are far from the targets and get one seed, the low-rank methods three.
SEEDS = 3
ONE_SEED = ("sign_sgd", "topk_sgd")
_BF16 = tuple(v for v in VARIANTS if VARIANTS[v].comm_dtype)
_FLOAT32 = tuple(v for v in VARIANTS if v not in _BF16)
# The bfloat16 variants at Power-SGD rank r's bytes.
_AT_POWER_SGD_BYTES = ("power_sgd_2r_bf16_warm", "acp_sgd_4r_bf16_warm")
TASK_VARIANTS = {
    "char_lm": _FLOAT32 + _AT_POWER_SGD_BYTES,
    "char_lm_sgd": (
        "ssgd",
        "power_sgd_warm",
        "acp_sgd_warm",
        "acp_sgd_2r_warm",
    ),
    "char_lm_long": (
        "ssgd",
        "acp_sgd_2r_warm",
        "power_sgd_warm",
        *_AT_POWER_SGD_BYTES,
    ),
    # Power-SGD and ACP-SGD at equal bytes, after the warm-up.
    "bert_mlm": ("ssgd", "power_sgd_warm", "acp_sgd_2r_warm"),
    "mnist": (
        tuple(
            v
            for v in _FLOAT32
            if v not in ("power_sgd_warm", "acp_sgd_warm_cold")
        )
        + ("acp_sgd_2r_bf16_warm",)
    ),
    # Power-SGD at r and ACP-SGD at 2r: the same float32 bytes per step.
    "mnist_long": ("ssgd", "power_sgd_warm", "acp_sgd_2r_warm"),
}
QUICK_VARIANTS = ("ssgd", "acp_sgd", "acp_sgd_warm")
# Quick runs shrink the budget and the models: a smoke test.
QUICK_STEPS = 24
QUICK_WARMUP_STEPS = 8


def config_name(task: str) -> str:
  """The module under ``configs/`` that ``task`` trains."""
  return TASKS[task][0]


def data_flag(task: str) -> str:
  """The command-line flag that gives ``task``'s data path."""
  return "mnist_path" if config_name(task) == "mnist" else "char_lm_path"


def rank(task: str, variant: str) -> int | None:
  """The rank ``variant`` trains ``task`` at (None: no rank)."""
  factor = VARIANTS[variant].rank_factor
  if factor is None:
    return None
  cfg = workloads.load_config(*TASKS[task])
  return factor * cfg.compressor.power_sgd.rank


def warmup_steps(variant: str, quick: bool) -> int:
  """The dense steps ``variant`` takes first (fewer in a quick run)."""
  warmup = VARIANTS[variant].warmup
  return QUICK_WARMUP_STEPS if quick and warmup else warmup


def config(
    task: str,
    variant: str,
    data_path: str,
    quick: bool,
    seed: int = 0,
    tokenizer: str = "",
    eval_every: int | None = None,
) -> ml_collections.ConfigDict:
  """The training config of ``task`` with ``variant``'s compressor; a
  masked-LM task reads its WordPiece tokenizer from ``tokenizer`` (trained
  and written there first if absent; "": beside ``data_path``), and
  ``eval_every`` (steps between held-out evaluations) replaces the task's.

  Raises:
    FileNotFoundError: if ``data_path`` is empty or does not exist.
  """
  cfg = workloads.load_config(*TASKS[task])
  flag = f"--{data_flag(task)}"
  if not data_path:
    raise FileNotFoundError(
        f"the {task} task needs {flag}: {data.DATA_SOURCES[cfg.data.name]}"
    )
  if not os.path.exists(data_path):
    raise FileNotFoundError(
        f"{task}: data path {data_path!r} does not exist; pass it with {flag}"
    )
  v = VARIANTS[variant]
  cfg.seed = seed
  cfg.compressor.name = v.compressor
  if v.rank_factor is not None:
    args = cfg.compressor[v.compressor]
    args.rank = rank(task, variant)
    args.warmup_steps = warmup_steps(variant, quick)
    args.warmup_factors = v.warm_factors
    args.comm_dtype = v.comm_dtype
  cfg.data.path = data_path
  if cfg.data.name == "masked_text":
    cfg.data.tokenizer = tokenizer
  cfg.log_every_steps = 10
  if quick:
    cfg.num_train_steps = QUICK_STEPS
    cfg.eval_every_steps = QUICK_STEPS // 2
    cfg.log_every_steps = 4
    cfg.schedule.warmup_steps = 4
    if config_name(task) == "mnist":
      cfg.model.width = 8
      cfg.data.eval_examples = 200
    elif cfg.model.name == "bert":
      cfg.model.size = {"num_layers": 1, "hidden": 64, "heads": 2, "ffn": 128}
    else:
      cfg.model.update(dim=32, num_layers=1, num_heads=2)
  if eval_every is not None:
    cfg.eval_every_steps = eval_every
  # One checkpoint, at the end: the benchmark measures training, not saving.
  cfg.checkpoint_every_steps = 0
  return cfg


def run(
    task: str,
    variant: str,
    data_path: str,
    quick: bool,
    seed: int,
    tokenizer: str = "",
    eval_every: int | None = None,
):
  """Trains one variant on ``task`` (``tokenizer`` and ``eval_every`` as
  ``config`` reads them); its final record and curve."""
  cfg = config(task, variant, data_path, quick, seed, tokenizer, eval_every)
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    summary = train.train_and_evaluate(cfg, workdir)
    seconds = time.perf_counter() - start
    lines = metrics_lib.read_curves(workdir)
  about = {
      "task": task,
      "variant": variant,
      "optimizer": cfg.optimizer.name,
      "compressor": cfg.compressor.name,
      "rank": cfg.compressor[cfg.compressor.name].get("rank"),
      "comm_dtype": cfg.compressor[cfg.compressor.name].get("comm_dtype"),
      "warmup_steps": (
          cfg.compressor[cfg.compressor.name].get("warmup_steps", 0)
      ),
      "seed": seed,
  }
  curve = [
      {
          **about,
          "step": line["step"],
          "bytes_sent": line.get("bytes_sent_total"),
          "loss": line.get("loss"),
          "eval_loss": line.get("eval_loss"),
          "eval_accuracy": line.get("eval_accuracy"),
      }
      for line in lines
  ]
  final = {
      **about,
      "model": cfg.model.name,
      "steps": summary["step"],
      "global_batch": cfg.batch_size,
      "num_devices": summary["num_devices"],
      "eval_loss": summary["eval_loss"],
      "eval_accuracy": summary["eval_accuracy"],
      "loss": summary["loss"],
      "bytes_per_step": summary["bytes_per_step"],
      "bytes_sent": summary["bytes_sent"],
      "wall_seconds": seconds,
  }
  return final, curve


def plan(
    tasks: list[str],
    quick: bool,
    variants: list[str] | None = None,
    seeds: list[int] | None = None,
) -> list[tuple[int, str, str]]:
  """``(seed, task, variant)`` of every run, a seed's runs before the next
  seed's, so that a cut run still holds every variant; with ``variants``,
  only those, in that order; with ``seeds``, only those seeds (a screen at
  one seed), else ``SEEDS`` of them.

  Raises:
    ValueError: if ``variants`` names an unknown variant.
  """
  unknown = sorted(set(variants or ()) - set(VARIANTS))
  if unknown:
    raise ValueError(
        f"unknown variant(s) {', '.join(unknown)}; choose from"
        f" {', '.join(VARIANTS)}"
    )
  runs = []
  if quick:  # a long task is a short one at more steps
    tasks = [t for t in tasks if t not in LONG_TASKS]
  if seeds is None:
    seeds = range(1 if quick else SEEDS)
  for seed in seeds:
    for task in tasks:
      own = QUICK_VARIANTS if quick else TASK_VARIANTS[task]
      for variant in [v for v in variants if v in own] if variants else own:
        if seed == 0 or variant not in ONE_SEED:
          runs.append((seed, task, variant))
  return runs


def measure(
    paths: dict[str, str],
    quick: bool,
    log_path: str | None = None,
    variants: list[str] | None = None,
    seeds: list[int] | None = None,
    tokenizer: str = "",
    eval_every: int | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Final records and curve points of every run of ``plan``, a masked-LM
  task's with ``tokenizer``, each evaluated every ``eval_every`` steps
  (as ``config`` reads them).

  Each run's record is also appended to ``log_path`` (JSON lines) as soon
  as it ends, so that an interrupted benchmark keeps what it measured.
  """
  for task, path in paths.items():
    config(task, "ssgd", path, quick)  # a missing file fails before training
  finals, curves = [], []
  for seed, task, variant in plan(list(paths), quick, variants, seeds):
    final, curve = run(
        task, variant, paths[task], quick, seed, tokenizer, eval_every
    )
    finals.append(final)
    curves.extend(curve)
    print(
        f"{task} {variant} seed {seed}: eval loss {final['eval_loss']:.4f},"
        f" accuracy {final['eval_accuracy']:.4f}, {final['wall_seconds']:.0f} s",
        flush=True,
    )
    if log_path:
      with open(log_path, "a") as f:
        f.write(json.dumps({"final": final, "curve": curve}) + "\n")
  return finals, curves


HELP = "the compressors trained, at equal rank and bytes, several seeds"


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--mnist_path",
      help="folder of MNIST IDX files (needed by the mnist task)",
  )
  parser.add_argument(
      "--tasks",
      type=cli.names(tuple(TASKS), "task"),
      default="char_lm_long,char_lm_sgd,char_lm,mnist,mnist_long",
      help="comma-separated tasks, run in this order (default: %(default)s)",
  )
  parser.add_argument(
      "--variants",
      type=cli.names(tuple(VARIANTS), "variant"),
      help="comma-separated variants to run, in this order, of those each"
      " task runs (default: all of them)",
  )
  parser.add_argument(
      "--seeds",
      type=cli.ints_at_least(0),
      help="comma-separated seeds to run (default: 0 to"
      f" {SEEDS - 1}, Sign-SGD and Top-k at seed 0 only)",
  )
  parser.add_argument(
      "--eval_every",
      type=cli.int_at_least(1),
      help="steps between held-out evaluations (default: each task's own):"
      " curves that compose a time to quality are read at the steps where"
      " they were evaluated, so evaluate as often as the direct runs they"
      " are checked against (python -m benchmarks quality --eval_every)",
  )
  parser.add_argument(
      "--char_lm_path",
      help="plain-text file, e.g. tiny-shakespeare (needed by the char_lm"
      " and bert_mlm tasks)",
  )
  parser.add_argument(
      "--tokenizer",
      default="",
      help="the bert_mlm task's WordPiece tokenizer (JSON), trained on the"
      " text and written there if absent (default: beside the text)",
  )


def main(args) -> None:
  meta = cli.start(args, args.num_cpu_devices)
  os.makedirs(args.results_dir, exist_ok=True)
  log_path = os.path.join(args.results_dir, "convergence_runs.partial.jsonl")
  try:
    finals, curves = measure(
        {task: getattr(args, data_flag(task)) for task in args.tasks},
        args.quick,
        log_path,
        args.variants,
        args.seeds,
        args.tokenizer,
        args.eval_every,
    )
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  outputs = {"convergence": finals, "convergence_curves": curves}
  cli.finish(
      args,
      meta,
      outputs,
      convergence_summary.summarize(finals, curves),
      convergence_summary.COLUMNS,
  )
  if os.path.exists(log_path):
    os.remove(log_path)  # every run is in the records now
