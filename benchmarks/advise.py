"""Which compressor, at which rank, for a model on a cluster
(``acp_jax.advise``): measured on this device, predicted for the link.

  python -m benchmarks advise --model bert_base_2l --workers 4 \\
      --bandwidth 125e6 --latency 5e-5 [--json [FOLDER]]

The model is a training config of ``configs/`` (``--config``, with
``--set key=value`` overrides), a convergence task (``--task``: the model,
data and batch of the time-to-quality sweep) or a workload of
``benchmarks.workloads`` (``--model``, the cluster's among them). The link
is given (``--bandwidth`` in bytes per second, ``--latency`` in seconds) or
measured (``--measure_link``): every process of the cluster runs this
command with ``--coordinator_address``, ``--num_processes`` and
``--process_id``, the all-reduce microbenchmark of ``benchmarks.worker``
times the link between them, and process 0 gives the advice for as many
workers as processes.

The advice measures the errors of the candidates predicted fastest until
one is within the threshold; ``--measure_all`` measures every candidate's
(the report's records do, to check the advice at each point of the
cluster sweep and of the time-to-quality runs). ``--run_steps N`` also
trains S-SGD and each candidate within the threshold N steps with the
model's optimizer, on the simulated workers, and ranks by the time to
S-SGD's loss: each step's time times the steps the candidate takes per
S-SGD step (``acp_jax_tools.steps``).

``--calibrate --char_lm_path PATH`` writes the threshold's records into
the package (``acp_jax_tools/advice_calibration.json``): for each char-LM
variant of the convergence records (``convergence.json``) that trained
Power-SGD or ACP-SGD on the gradient after a dense warm-up that warmed its
factors, its
held-out loss gap to S-SGD (the mean over seeds) and its error and cosine
measured as the advice measures a candidate's
(``acp_jax_tools.advice.measure``: the same warm-up and steps) on the
convergence runs' char LM, workers and batch, from its initial params.
"""

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import jax

from acp_jax import registry
from acp_jax_tools import advice as advice_lib
from acp_jax_tools import calibration as calibration_lib
from acp_jax_tools import candidates
from acp_jax_tools import costmodel
from acp_jax_tools import steps as steps_lib
from benchmarks import cli
from benchmarks import convergence
from benchmarks import convergence_summary
from benchmarks import records
from benchmarks import worker
from benchmarks import workloads
from train import advice as train_advice
from train import runtime

HELP = "which compressor and rank for a model, workers and a link"

# The convergence runs the calibration reads, and the workers they ran on.
_TASK, _STEPS, _WORKERS = "char_lm", 300, 8
# The all-reduce sizes that ``--measure_link`` times.
_PSUM_SIZES = (4096, 65536, 1048576, 4194304)


def calibration_runs(results_dir) -> list[dict[str, Any]]:
  """The convergence variants the threshold is calibrated on: Power-SGD and
  ACP-SGD as the library makes them (no closed experiment's), trained after
  a dense warm-up that warmed their factors, as the advice measures its
  candidates; each with its candidate
  (and its name), its run's variant, its held-out loss gap to S-SGD (a
  fraction) and its seeds."""
  summary = convergence_summary.summarize(
      records.read("convergence", results_dir),
      records.read("convergence_curves", results_dir) or None,
  )
  runs = []
  for r in summary:
    # None: a closed experiment's run (its variant no longer exists).
    variant = convergence.VARIANTS.get(r["variant"])
    if (
        variant is not None
        and r["task"] == _TASK
        and r["steps"] == _STEPS
        and r["compressor"] in registry.low_rank()
        and variant.warmup
        and variant.warm_factors
    ):
      candidate = advice_lib.Candidate(
          r["compressor"], r["rank"], r["comm_dtype"]
      )
      runs.append(
          {
              "candidate": candidate,
              "variant": candidate.name,
              "run": r["variant"],
              "gap": r["loss_vs_ssgd_pct"] / 100,
              "seeds": r["seeds"],
              "warmup_steps": r["warmup_steps"],
          }
      )
  return sorted(runs, key=lambda r: r["variant"])


def calibration_measurement() -> dict[str, Any]:
  """How the calibration measures its errors: the advice's measurement on
  the convergence runs' char LM (``convergence.TASKS``), workers and
  batch."""
  config = workloads.load_config(*convergence.TASKS[_TASK])
  return {
      "config": f"configs/{convergence.config_name(_TASK)}.py",
      "global_batch": config.batch_size,
      "seq_len": config.data.seq_len,
      "workers": _WORKERS,
      "steps": advice_lib.STEPS,
      "warmup": advice_lib.WARMUP,
      "params": f"the config's initial params (seed {config.seed})",
  }


def calibration_source(runs, measurement) -> str:
  """The calibration's provenance, in a sentence."""
  m = measurement
  seeds = "/".join(str(s) for s in sorted({r["seeds"] for r in runs}))
  warmups = "/".join(str(s) for s in sorted({r["warmup_steps"] for r in runs}))
  return (
      "the error (squared distance to the true mean over its sampling"
      " noise) and the cosine as acp_jax.advise measures them"
      f" ({m['warmup']} dense steps"
      " that warm the factors, then the mean over"
      f" {m['steps'] - m['warmup']} compressed steps, at {m['params']} of"
      f" {m['config']}, batch {m['global_batch']} x {m['seq_len']} on"
      f" {m['workers']} simulated workers); the held-out loss gap to S-SGD"
      f" of the {_TASK} task trained {_STEPS} steps after {warmups} dense"
      f" ones that warmed the factors, the mean over {seeds} seeds"
      " (convergence.json: "
      + ", ".join(f"{r['run']} as {r['variant']}" for r in runs)
      + ")"
  )


def calibrate(results_dir, char_lm_path: str, progress=None) -> dict:
  """The threshold's records: each of ``calibration_runs``' variants with
  its error and cosine measured on the char LM at ``char_lm_path``."""
  runs = calibration_runs(results_dir)
  measurement = calibration_measurement()
  config = convergence.config(_TASK, "ssgd", char_lm_path, quick=False)
  loss_fn, params, batches, _ = train_advice.inputs(
      config, measurement["workers"], measurement["steps"]
  )
  measured = advice_lib.measure(
      loss_fn,
      params,
      batches,
      [r["candidate"] for r in runs],
      workers=measurement["workers"],
      warmup=measurement["warmup"],
      progress=progress,
  )
  return {
      "source": calibration_source(runs, measurement),
      "measurement": measurement,
      "points": [
          {
              "variant": r["variant"],
              "run": r["run"],
              "error_to_noise": measured.error_to_noise[r["variant"]],
              "cosine": measured.cosine[r["variant"]],
              "gap": r["gap"],
          }
          for r in runs
      ],
  }


def _given_links(args) -> list[advice_lib.Link]:
  """The links of ``--bandwidth`` and ``--latency``."""
  if args.bandwidth is None:
    raise SystemExit(
        "advise: give --bandwidth (and --latency), or --measure_link"
    )
  latency = args.latency
  if len(latency) == 1:
    latency = latency * len(args.bandwidth)
  if len(latency) != len(args.bandwidth):
    raise SystemExit(
        f"advise: --latency gives {len(latency)} values for"
        f" {len(args.bandwidth)} bandwidths; give one, or one each"
    )
  return [advice_lib.Link(b, a) for b, a in zip(args.bandwidth, latency)]


def _measured_link() -> tuple[list[advice_lib.Link], int]:
  """The link between this command's processes, and their number."""
  timed = worker.psum(
      argparse.Namespace(
          sizes=",".join(map(str, _PSUM_SIZES)), repeats=5, busy_mb=0.0
      )
  )["psum_seconds"]
  p = jax.process_count()
  fitted = costmodel.fit_all_reduce(
      _PSUM_SIZES, [timed[str(s)] for s in _PSUM_SIZES], p
  )
  return [advice_lib.Link(1 / fitted.beta, fitted.alpha)], p


def _inputs(args, workers: int):
  """The loss, params and ``--steps`` batches of ``--config``, ``--task``
  or ``--model``, and what its ``--run_steps`` short runs train on
  (``train.advice.inputs``)."""
  if args.task:
    path = getattr(args, convergence.data_flag(args.task))
    config = convergence.config(args.task, "ssgd", path, quick=False)
  elif args.config:
    config = workloads.load_config(args.config, tuple(args.set))
  elif args.model in workloads.CLUSTER_MODELS:
    config = workloads.cluster_config(args.model, "ssgd", args.steps)
  else:
    config = workloads.config(args.model, "ssgd")
  return train_advice.inputs(
      config, workers, args.steps, args.run_steps, args.run_repeats
  )


def _override(text: str) -> tuple[str, Any]:
  key, sep, value = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"must be key=value, got {text!r}")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value


def _bandwidths(text: str) -> list[float]:
  try:
    return [advice_lib.Link(float(t)).bandwidth for t in text.split(",")]
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _latencies(text: str) -> list[float]:
  try:
    return [advice_lib.Link(1.0, float(t)).latency for t in text.split(",")]
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
  model.add_argument(
      "--task",
      choices=tuple(convergence.TASKS),
      help="a convergence task (the time-to-quality sweep's model, data and"
      " batch), its data from --char_lm_path or --mnist_path",
  )
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
      type=_bandwidths,
      help="bytes per second of each worker's link (1 Gb/s: 1.25e8; inf);"
      " comma-separated, an advice for each, on the same measurements",
  )
  parser.add_argument(
      "--latency",
      type=_latencies,
      default=[0.0],
      help="seconds per message: one, or one per --bandwidth",
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
      default=advice_lib.STEPS,
      help="batches the errors are taken on (the first"
      f" {advice_lib.WARMUP} warm the factors up)",
  )
  parser.add_argument(
      "--run_steps",
      type=cli.int_at_least(0),
      default=0,
      help="train each candidate within the threshold, and S-SGD, this"
      " many steps with the model's optimizer, and rank by the time to"
      " S-SGD's loss (0: by the step's time; at least"
      f" {steps_lib.RUN_STEPS_MIN})",
  )
  parser.add_argument(
      "--run_repeats",
      type=cli.int_at_least(1),
      default=1,
      help="--run_steps runs of each, the batches in other orders; the"
      " median of their steps",
  )
  parser.add_argument(
      "--ranks",
      type=cli.ints_at_least(1),
      default=list(candidates.RANKS),
      help="comma-separated ranks of Power-SGD and ACP-SGD",
  )
  parser.add_argument(
      "--measure_all",
      action="store_true",
      help="measure every candidate's error, not only until the pick's",
  )
  parser.add_argument(
      "--max_gap",
      type=float,
      default=calibration_lib.MAX_GAP,
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
      help="write the threshold's records into acp_jax: the convergence"
      " records' loss gaps, the errors measured on --char_lm_path",
  )
  parser.add_argument(
      "--char_lm_path",
      help="tiny-shakespeare's input.txt (--calibrate, a char_lm --task)",
  )
  parser.add_argument("--mnist_path", help="MNIST's folder (an mnist --task)")


def _progress(start: float):
  def say(line: str) -> None:
    elapsed = time.perf_counter() - start
    print(f"  {elapsed:6.1f} s  {line}", file=sys.stderr, flush=True)

  return say


def main(args) -> None:
  if args.calibrate:
    path = pathlib.Path(calibration_lib.__file__).parent
    path /= calibration_lib.CALIBRATION_FILE
    if not args.char_lm_path:
      raise SystemExit(
          "advise --calibrate: give --char_lm_path (tiny-shakespeare's"
          " input.txt), the text the errors are measured on"
      )
    cli.start(args, 1)
    calibration = calibrate(
        args.results_dir, args.char_lm_path, _progress(time.perf_counter())
    )
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"wrote {path}")
    print(advice_lib.Calibration.recorded(args.max_gap).describe())
    return
  if [args.model, args.config, args.task].count(None) != 2:
    raise SystemExit("advise: give --model, --config or --task")
  if args.workers is None and not args.measure_link:
    raise SystemExit("advise: give --workers (or --measure_link)")
  given = None if args.measure_link else _given_links(args)
  start = time.perf_counter()
  if args.measure_link:
    runtime.setup(
        num_cpu_devices=1,
        **{
            k: getattr(args, k)
            for k in ("coordinator_address", "num_processes", "process_id")
        },
    )
  # One device: the workers are simulated by vmap (acp_jax_tools.simulated).
  meta = cli.start(args, None if args.measure_link else 1)
  links, measured_workers = (
      (given, None) if given else _measured_link()
  )
  if jax.process_index():
    print(f"link measured: {links[0]}; process 0 gives the advice")
    return
  rows = []
  for workers in args.workers or [measured_workers]:
    loss_fn, params, batches, short_runs = _inputs(args, workers)
    measured = None  # the first link's measurements serve every link
    for link in links:
      advice = advice_lib.advise(
          loss_fn,
          params,
          batches,
          workers=workers,
          link=link,
          candidates=advice_lib.default_candidates(ranks=args.ranks),
          max_gap=args.max_gap,
          overlap=args.overlap,
          measurements=measured,
          measure_all=args.measure_all,
          short_runs=short_runs,
          progress=_progress(start),
      )
      measured = advice.measurements
      wall = time.perf_counter() - start
      print(advice.table())
      print(f"advice took {wall:.1f} s since the start")
      model = args.model or args.config or args.task
      rows += [
          {**r, "model": model, "wall_s": wall} for r in advice.to_record()
      ]
  if args.json is not None:
    path = records.write(
        "advice", [{**r, **meta} for r in rows], args.json or args.results_dir
    )
    print(f"wrote {path}")
