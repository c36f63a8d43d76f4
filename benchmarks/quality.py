"""Time to quality across the shaped link: each variant of a convergence task
trained by the trainer, one process per worker in its own network
namespace, until its held-out loss reaches a target or its step cap.

  python -m benchmarks quality --task char_lm --char_lm_path input.txt \
      --variants ssgd,power_sgd_warm,acp_sgd_2r_warm --workers 2 \
      --bandwidths 100mbit --target ssgd_half --steps 600 --eval_every 25

The target is a held-out loss, or the name of one of S-SGD's targets
(``time_to_quality.targets``: ``ssgd_final``, ``ssgd_half``) on the task's
S-SGD curves in ``--results_dir``, trained on as many simulated devices as
there are workers (``python -m benchmarks --num_cpu_devices N convergence``),
so at the same global batch. Every variant runs ``--repeats`` times per
link, the rounds interleaved, round i from the i-th of ``--seeds`` (in
turn): every variant of a round trains the same seed, so a round compares
the methods on one draw of the initial params and the data order, and
rounds of several seeds show the training's spread as well as the
timing's. A record holds, per worker count, link and variant, each round's
seed, training seconds to the target (evaluations left out), steps and
bytes, and the median step; where that task's curves hold the variant at
that device count, also the time composed from their steps to the target
and this run's step time, and whether it lies within
``thresholds.COMPOSED_VS_DIRECT`` of the direct run. A variant named in
``--compose`` is not run to the target: each round trains
``--compose_steps`` steps for its step time, and its time to the target is
only the composed one, whose rule the direct runs of other links check.
"""

import importlib.util
import math
import signal
import statistics
import sys
import tempfile
from typing import Any

from benchmarks import cli
from benchmarks import convergence
from benchmarks import convergence_summary
from benchmarks import launch
from benchmarks import links
from benchmarks import records
from benchmarks import time_to_quality

HELP = "time to a held-out loss on shaped links, one trainer per worker"

# PyTorch DDP's methods (``benchmarks.torch_quality``), for the char LM:
# its all-reduce of buckets while backprop runs (the paper's optimized
# S-SGD), and its PowerSGD hook at the config's rank.
TORCH_VARIANTS = {
    "torch_ssgd": convergence.Variant("ssgd", None, 0, False),
    "torch_power_sgd": convergence.Variant("power_sgd", 1, 0, False),
}
TORCH_TASKS = ("char_lm", "char_lm_sgd")


def variant_spec(name: str) -> convergence.Variant:
  """A variant of ``--variants``: a convergence variant, or PyTorch's."""
  return TORCH_VARIANTS.get(name) or convergence.VARIANTS[name]

COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "variant": "variant",
    "target_loss": "target",
    "reached": "reached",
    "steps": "steps",
    "train_seconds": "seconds",
    "train_seconds_min": "min",
    "train_seconds_max": "max",
    "steady_seconds": "steady",
    "composed_seconds": "composed",
    "composed_agrees": "agrees",
}


def simulated_curves(
    results_dir: str, task: str, devices: int
) -> dict[str, time_to_quality.Curves]:
  """``task``'s held-out curves in ``results_dir`` trained on ``devices``
  simulated devices, by variant and seed, but for the seeds whose S-SGD run
  never left its starting plateau (``convergence_summary``): their S-SGD
  loss would be the target, one every method reaches at once."""
  try:
    finals = records.read("convergence", results_dir)
    points = records.read("convergence_curves", results_dir)
  except FileNotFoundError:
    return {}
  runs = {
      (r["variant"], r["seed"])
      for r in finals
      if r["task"] == task and r.get("num_devices") == devices
  }
  mine = [p for p in points if (p["variant"], p["seed"]) in runs]
  untrained = convergence_summary.untrained_seeds(mine)
  return time_to_quality.curves(
      [p for p in mine if (task, p["seed"]) not in untrained], task
  )


def target_loss(target: str, curves: dict[str, Any]) -> float:
  """``--target``: a held-out loss, or one of S-SGD's named targets on
  ``curves``."""
  try:
    return float(target)
  except ValueError:
    pass
  if "ssgd" not in curves:
    raise ValueError(
        f"--target={target}: no S-SGD curves of this task at this many"
        " devices; run python -m benchmarks --num_cpu_devices N convergence"
        " --tasks TASK --variants ssgd first, or give a loss"
    )
  named = time_to_quality.targets(curves["ssgd"])
  if target not in named:
    raise ValueError(
        f"--target must be a loss or one of {', '.join(named)}, got {target!r}"
    )
  return named[target][1]


def _run(
    network, args, variant, seed, target, workdir
) -> list[dict[str, Any]]:
  steps = args.compose_steps if variant in args.compose else args.steps
  flags = [
      f"--task={args.task}",
      f"--seed={seed}",
      f"--data_path={getattr(args, convergence.data_flag(args.task))}",
      f"--steps={steps}",
      f"--eval_every={min(args.eval_every, steps)}",
      f"--target={target}",
      *(["--quick"] if args.quick else []),
  ]
  if variant in TORCH_VARIANTS:
    v = TORCH_VARIANTS[variant]
    return launch.on_network(
        network,
        lambda i: [
            sys.executable,
            "-m",
            "benchmarks.torch_quality",
            f"--method={v.compressor}",
            f"--rank={convergence.rank(args.task, 'power_sgd')}",
            *flags,
            *launch.torch_distributed(network, i),
        ],
        args.timeout,
    )
  return launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "quality",
          f"--variant={variant}",
          f"--workdir={workdir}",
          *flags,
          *launch.distributed(network, i),
      ),
      args.timeout,
  )


def record(
    rounds: list[dict[str, Any]],
    target: float,
    simulated: time_to_quality.Curves | None,
    warmup: int = 0,
    seeds: list[int] | None = None,
) -> dict[str, Any]:
  """A variant's record from its rounds (process 0's results): training
  seconds to the target, steps and bytes, each round's and their median and
  range; None (never) where a round hit its cap, or the simulated curve
  never reached the target.

  ``train_seconds`` is what a user waits, the first steps' compilation
  included; ``steady_seconds`` leaves out what the first evaluation
  interval took beyond its steps at the round's step time (compilation,
  mostly). For a variant with ``warmup`` dense steps, whose mean step mixes
  the two phases, each phase's step time comes from the round's curve
  (``time_to_quality.phase_step_seconds``). With ``simulated`` curves of
  the variant, each simulated seed's steps to the target, their median, each
  round's time composed from its step times and the steps of its own seed
  (``seeds``, each round's; None: not known) where that seed was
  simulated, else the median, and whether their median agrees with the
  direct ``steady_seconds``.
  """
  seeds = [None] * len(rounds) if seeds is None else seeds
  reached = [r["summary"]["target_step"] is not None for r in rounds]
  step_seconds = [
      r["global_batch"] / r["summary"]["examples_per_sec"] for r in rounds
  ]
  # Each round's (dense, compressed) step seconds; a phase with no interval
  # between evaluations of its own (a target reached early) at the mean.
  phases = [
      tuple(
          step_s if math.isnan(x) else x
          for x in time_to_quality.phase_step_seconds(
              [(p["step"], p["train_seconds"]) for p in r["curve"]], warmup
          )
      )
      if warmup
      else (0.0, step_s)
      for r, step_s in zip(rounds, step_seconds)
  ]
  seconds, steady = [], []
  for r, ok, (dense, step_s) in zip(rounds, reached, phases):
    first = r["curve"][0]
    startup = max(
        first["train_seconds"]
        - time_to_quality.composed(first["step"], step_s, warmup, dense),
        0.0,
    )
    total = r["summary"]["train_seconds"] if ok else math.inf
    seconds.append(total)
    steady.append(total - startup)
  out = {
      "target_loss": target,
      "reached": f"{sum(reached)}/{len(rounds)}",
      # Each round's seed, as records.runs(r, "seed") reads them.
      **{f"seed_run{i}": x for i, x in enumerate(seeds, 1) if x is not None},
      **records.repeated(
          "steps", [r["summary"]["target_step"] or math.inf for r in rounds]
      ),
      "bytes_sent": statistics.median(
          r["summary"]["bytes_sent"] for r in rounds
      ),
      **records.repeated("train_seconds", seconds),
      **records.repeated("steady_seconds", steady),
      **records.repeated("step_s", step_seconds),
  }
  if simulated:
    # Each simulated seed's steps to the target, so that a composed figure
    # traces to its record.
    simulated_steps = {
        seed: time_to_quality.steps_to(curve, target)
        for seed, curve in sorted(simulated.items())
    }
    out.update({
        f"composed_steps_seed{seed}": n for seed, n in simulated_steps.items()
    })
    steps = out["composed_steps"] = statistics.median(simulated_steps.values())
    each = [
        time_to_quality.composed(
            simulated_steps.get(seed, steps), step_s, warmup, dense
        )
        for seed, (dense, step_s) in zip(seeds, phases)
    ]
    out.update(records.repeated("composed_seconds", each))
    out["composed_seconds"] = statistics.median(each)
    out["composed_warmup"] = warmup  # the dense steps it priced as such
    # Seeds that did not reach the target within their runs compose no
    # time: nothing to check.
    out["composed_agrees"] = (
        time_to_quality.agrees(out["composed_seconds"], out["steady_seconds"])
        if math.isfinite(out["composed_seconds"])
        else None
    )
  return {
      k: None if isinstance(v, float) and not math.isfinite(v) else v
      for k, v in out.items()
  }


def curve_points(run: dict[str, Any], rounds) -> list[dict[str, Any]]:
  """Each round's held-out loss against its training seconds, flat."""
  keys = ("task", "workers", "bandwidth", "variant")
  return [
      {**{k: run[k] for k in keys}, "seed": seed, "round": i + 1, **point}
      for i, (r, seed) in enumerate(zip(rounds, records.runs(run, "seed")))
      for point in r["curve"]
  ]


def measure(args) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
  """Every (worker count, link, variant) record, the curves' points, and
  the failed runs."""
  runs, points, failures = [], [], []
  curves = {
      p: simulated_curves(args.results_dir, args.task, p) for p in args.workers
  }
  targets = {p: target_loss(args.target, curves[p]) for p in args.workers}
  for p, bandwidth, network in launch.each_link(args.workers, args.bandwidths):
    rounds = {v: [] for v in args.variants}
    for rep in range(args.repeats):
      seed = args.seeds[rep % len(args.seeds)]
      for variant in args.variants:
        with tempfile.TemporaryDirectory() as workdir:
          out = launch.attempt(
              failures,
              f"{p} workers {bandwidth} {variant} round {rep + 1}",
              lambda: _run(network, args, variant, seed, targets[p], workdir),
          )
        if out is not None:
          rounds[variant].append((out[0], seed))
    for variant, done in rounds.items():
      if done:
        results, seeds = map(list, zip(*done))
        runs.append({
            "task": args.task,
            "workers": p,
            "bandwidth": bandwidth,
            "variant": variant,
            "composed_only": variant in args.compose,
            **record(
                results,
                targets[p],
                curves[p].get(variant),
                0
                if variant in TORCH_VARIANTS
                else convergence.warmup_steps(variant, args.quick),
                seeds,
            ),
        })
        points.extend(curve_points(runs[-1], results))
  return runs, points, failures


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--task",
      choices=tuple(convergence.TASKS),
      default="char_lm",
      help="a convergence task (default: %(default)s)",
  )
  parser.add_argument(
      "--variants",
      type=cli.names(
          tuple(convergence.VARIANTS) + tuple(TORCH_VARIANTS), "variant"
      ),
      default="ssgd,power_sgd_warm,acp_sgd_2r_warm",
      help="comma-separated convergence variants, and PyTorch DDP's"
      f" ({', '.join(TORCH_VARIANTS)}; the char LM only, with the torch"
      " extra installed) (default: %(default)s)",
  )
  parser.add_argument("--workers", type=cli.ints_at_least(2), default="2")
  parser.add_argument(
      "--bandwidths",
      type=cli.names(tuple(launch.BANDWIDTHS), "bandwidth"),
      default="100mbit",
  )
  parser.add_argument(
      "--target",
      default="ssgd_half",
      help="held-out loss to reach, or ssgd_final / ssgd_half (S-SGD's, from"
      " the task's simulated curves at the same device count)",
  )
  parser.add_argument("--steps", type=cli.int_at_least(1), default=600)
  parser.add_argument(
      "--compose",
      type=cli.names(tuple(convergence.VARIANTS), "variant"),
      default="",
      help="variants (of --variants) whose time to the target is composed,"
      " not run: each round trains --compose_steps steps for its step time,"
      " and the task's simulated curve gives its steps to the target (for"
      " S-SGD on a slow link, whose direct run would take most of the sweep)",
  )
  parser.add_argument(
      "--compose_steps", type=cli.int_at_least(2), default=30
  )
  parser.add_argument("--eval_every", type=cli.int_at_least(1), default=25)
  parser.add_argument("--repeats", type=cli.int_at_least(1), default=3)
  parser.add_argument(
      "--seeds",
      type=cli.ints_at_least(0),
      default="0,1,2",
      help="comma-separated seeds, one per round in turn, the same for every"
      " variant of a round (default: %(default)s): as many as --repeats, and"
      " simulated, the rounds sample the training's spread, and each"
      " round's composed time takes its own seed's steps",
  )
  parser.add_argument(
      "--timeout", type=float, default=3600, help="seconds per run"
  )
  parser.add_argument("--char_lm_path", help="plain-text file (char_lm)")
  parser.add_argument("--mnist_path", help="folder of MNIST IDX files")


def main(args) -> None:
  if not getattr(args, convergence.data_flag(args.task)):
    raise SystemExit(
        f"error: --{convergence.data_flag(args.task)} is needed by"
        f" {args.task}"
    )
  stray = sorted(set(args.compose) - set(args.variants))
  if stray:
    raise SystemExit(f"error: --compose names {stray}, not in --variants")
  torch = [v for v in args.variants if v in TORCH_VARIANTS]
  if torch and args.task not in TORCH_TASKS:
    raise SystemExit(
        f"error: --variants={','.join(torch)} trains the char LM only"
        f" (--task=char_lm or char_lm_sgd), not --task={args.task}"
    )
  if torch and importlib.util.find_spec("torch") is None:
    raise SystemExit(
        f"error: --variants={','.join(torch)} needs PyTorch: pip install"
        ' -e ".[torch]"'
    )
  if len(args.seeds) > args.repeats:
    raise SystemExit(
        f"error: --seeds names {len(args.seeds)} seeds, more than"
        f" --repeats={args.repeats} rounds train"
    )
  reason = links.unavailable()
  if reason:
    print(f"quality: skipped, {reason}")
    return
  meta = cli.start(args, 1)  # each worker is a process of its own device
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  try:
    runs, points, failures = measure(args)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  outputs = {"quality": runs, "quality_curves": points}
  cli.finish(args, meta, outputs, runs, COLUMNS, failures)
