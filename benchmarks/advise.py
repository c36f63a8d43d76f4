"""Which compressor, at which rank, for a model on a cluster
(``acp_jax.advise``): measured on this device, predicted for the link.

  python -m benchmarks advise --model bert_base_2l --workers 4 \\
      --bandwidth 125e6 --latency 5e-5 [--json [FOLDER]]

The model is a training config of ``configs/`` (``--config``, with
``--set key=value`` overrides) or a workload of ``benchmarks.workloads``
(``--model``, the cluster's among them). The link is given
(``--bandwidth`` in bytes per second, ``--latency`` in seconds) or measured
(``--measure_link``): every process of the cluster runs this command with
``--coordinator_address``, ``--num_processes`` and ``--process_id``, the
all-reduce microbenchmark of ``benchmarks.worker`` times the link between
them, and process 0 gives the advice for as many workers as processes.

``--calibrate`` writes the threshold's records into the package
(``acp_jax/advice_calibration.json``) from the convergence records: for
each variant of the direction benchmark (``convergence_direction.json``,
the compressor as it is) that the convergence runs trained with the same
dense warm-up, its ``grad`` cosine and its held-out loss gap to S-SGD
(``convergence.json``, the mean over seeds).
"""

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Any

import jax

from acp_jax import advice as advice_lib
from acp_jax import costmodel
from benchmarks import cli
from benchmarks import convergence
from benchmarks import convergence_summary
from benchmarks import records
from benchmarks import worker
from benchmarks import workloads
from train import advice as train_advice
from train import runtime

HELP = "which compressor and rank for a model, workers and a link"

# A direction variant as the compressor is (no Adam geometry): method, rank,
# and "_bf16" for bfloat16 factors.
_VARIANT = re.compile(r"(power_sgd|acp_sgd)_r(\d+)(_bf16)?")
# The convergence runs the calibration reads.
_TASK, _STEPS = "char_lm", 300
# The all-reduce sizes that ``--measure_link`` times.
_PSUM_SIZES = (4096, 65536, 1048576, 4194304)


def calibration_points(results_dir) -> dict[str, Any]:
  """The threshold's records (``acp_jax.advice.Calibration``), from the
  direction and convergence records in ``results_dir``."""
  summary = convergence_summary.summarize(
      records.read("convergence", results_dir),
      records.read("convergence_curves", results_dir) or None,
  )
  # The direction benchmark warms the factors through the dense steps: the
  # runs that did not (the "cold" one) are not its variants.
  runs = {
      (r["compressor"], r["rank"], r["comm_dtype"], r["warmup_steps"]): r
      for r in summary
      if r["task"] == _TASK
      and r["steps"] == _STEPS
      and r["compress"] == "gradient"
      and (
          convergence.VARIANTS[r["variant"]].warm_factors
          or not r["warmup_steps"]
      )
  }
  points, used = [], []
  for d in records.read("convergence_direction", results_dir):
    match = _VARIANT.fullmatch(d["variant"])
    if not match:
      continue
    method, rank, bf16 = match.groups()
    key = (method, int(rank), "bfloat16" if bf16 else None, d["warmup_steps"])
    if key in runs:
      used.append((d, runs[key]))
      points.append(
          {
              "variant": d["variant"],
              "cosine": d["grad"],
              "gap": runs[key]["loss_vs_ssgd_pct"] / 100,
          }
      )
  seeds = sorted({run["seeds"] for _, run in used})
  used = [d for d, _ in used]
  source = (
      f"the {_TASK} task (configs/tinyshakespeare.py, AdamW) trained"
      f" {_STEPS} steps after {used[0]['warmup_steps']} dense ones, the"
      f" held-out loss averaged over {'/'.join(map(str, seeds))} seeds"
      " (convergence.json); the cosine of the compressed mean gradient with"
      f" the true mean averaged over {used[0]['steps']} steps on"
      f" {used[0]['machine'].rsplit(', ', 1)[-1]}"
      " (convergence_direction.json)"
  )
  return {"source": source, "points": points}


def _link(args) -> tuple[advice_lib.Link, int]:
  """The link and the number of workers: as given, or measured between this
  command's processes."""
  if not args.measure_link:
    if args.bandwidth is None:
      raise SystemExit(
          "advise: give --bandwidth (and --latency), or --measure_link"
      )
    return advice_lib.Link(args.bandwidth, args.latency), args.workers
  timed = worker.psum(
      argparse.Namespace(
          sizes=",".join(map(str, _PSUM_SIZES)), repeats=5, busy_mb=0.0
      )
  )["psum_seconds"]
  p = jax.process_count()
  fitted = costmodel.fit_all_reduce(
      _PSUM_SIZES, [timed[str(s)] for s in _PSUM_SIZES], p
  )
  return advice_lib.Link(1 / fitted.beta, fitted.alpha), p


def _inputs(args, workers: int):
  """The loss, params and batches of ``--config`` or ``--model``."""
  if args.config:
    config = workloads.load_config(args.config, tuple(args.set))
  elif args.model in workloads.CLUSTER_MODELS:
    config = workloads.cluster_config(args.model, "ssgd", args.steps)
  else:
    config = workloads.config(args.model, "ssgd")
  return train_advice.inputs(config, workers, args.steps)


def _override(text: str) -> tuple[str, Any]:
  key, sep, value = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"must be key=value, got {text!r}")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value


def _bandwidth(text: str) -> float:
  try:
    value = float(text)
    return advice_lib.Link(value).bandwidth
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
  cli.add_quick(parser)
  model = parser.add_mutually_exclusive_group()
  model.add_argument(
      "--model",
      choices=(*workloads.WORKLOADS, *workloads.CLUSTER_MODELS),
      help="a workload of benchmarks/workloads.py (e.g. bert_base_2l)",
  )
  model.add_argument("--config", help="a module of configs/, e.g. mnist")
  parser.add_argument(
      "--set",
      type=_override,
      action="append",
      default=[],
      help="with --config: a dotted key=value override (repeatable)",
  )
  parser.add_argument(
      "--workers",
      type=cli.ints_at_least(1),
      help="comma-separated worker counts, an advice for each",
  )
  parser.add_argument(
      "--bandwidth",
      type=_bandwidth,
      help="bytes per second of each worker's link (1 Gb/s: 1.25e8; inf)",
  )
  parser.add_argument(
      "--latency", type=float, default=0.0, help="seconds per message"
  )
  parser.add_argument(
      "--measure_link",
      action="store_true",
      help="time all-reduces between this command's processes",
  )
  for flag in ("coordinator_address", "num_processes", "process_id"):
    parser.add_argument(f"--{flag}", type=str if "address" in flag else int)
  parser.add_argument(
      "--steps",
      type=cli.int_at_least(2),
      default=3,
      help="batches the cosines are taken on (the first one settles)",
  )
  parser.add_argument(
      "--ranks",
      type=cli.ints_at_least(1),
      default=list(advice_lib.RANKS),
      help="comma-separated ranks of Power-SGD and ACP-SGD",
  )
  parser.add_argument(
      "--max_gap",
      type=float,
      default=advice_lib.MAX_GAP,
      help="the held-out loss gap to S-SGD the threshold promises (0.1: 10%%)",
  )
  parser.add_argument(
      "--overlap",
      action="store_true",
      help="the runtime hides communication behind backprop (GPUs)",
  )
  parser.add_argument(
      "--json",
      nargs="?",
      const="",
      help="write the advice as records into this folder (advice.json;"
      " without a folder, --results_dir)",
  )
  parser.add_argument(
      "--calibrate",
      action="store_true",
      help="write the threshold's records into acp_jax from the results",
  )


def _progress(start: float):
  def say(line: str) -> None:
    elapsed = time.perf_counter() - start
    print(f"  {elapsed:6.1f} s  {line}", file=sys.stderr, flush=True)

  return say


def main(args) -> None:
  if args.calibrate:
    path = (
        pathlib.Path(advice_lib.__file__).parent / advice_lib.CALIBRATION_FILE
    )
    path.write_text(
        json.dumps(calibration_points(args.results_dir), indent=1) + "\n"
    )
    print(f"wrote {path}")
    print(advice_lib.Calibration.recorded(args.max_gap).describe())
    return
  if (args.model is None) == (args.config is None):
    raise SystemExit("advise: give --model or --config")
  if args.workers is None and not args.measure_link:
    raise SystemExit("advise: give --workers (or --measure_link)")
  start = time.perf_counter()
  if args.measure_link:
    runtime.setup(
        num_cpu_devices=1,
        **{
            k: getattr(args, k)
            for k in ("coordinator_address", "num_processes", "process_id")
        },
    )
  # One device: the workers are simulated by vmap (acp_jax.simulated).
  meta = cli.start(args, None if args.measure_link else 1)
  link, measured_workers = _link(args)
  if jax.process_index():
    print(f"link measured: {link}; process 0 gives the advice")
    return
  rows = []
  for workers in args.workers or [measured_workers]:
    loss_fn, params, batches = _inputs(args, workers)
    advice = advice_lib.advise(
        loss_fn,
        params,
        batches,
        workers=workers,
        link=link,
        candidates=advice_lib.default_candidates(ranks=args.ranks),
        max_gap=args.max_gap,
        overlap=args.overlap,
        progress=_progress(start),
    )
    wall = time.perf_counter() - start
    print(advice.table())
    print(f"advice took {wall:.1f} s since the start")
    model = args.model or args.config
    rows += [{**r, "model": model, "wall_s": wall} for r in advice.to_record()]
  if args.json is not None:
    path = records.write(
        "advice", [{**r, **meta} for r in rows], args.json or args.results_dir
    )
    print(f"wrote {path}")
