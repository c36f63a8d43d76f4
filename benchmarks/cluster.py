"""A real cluster on one machine: N worker processes, each in its own network
namespace on a switched link of 1 Gb/s, 10 Gb/s or unshaped
(``benchmarks/links.py``), training with ``jax.distributed`` over gloo, and
PyTorch DDP (plain and with its PowerSGD hook) on the very same links.

Per worker count and bandwidth, a psum microbenchmark calibrates the cost
model's alpha and beta twice: on idle workers, and right after a pass over
memory, as a step's collectives follow its compute (``calibrate``). Each
compressor then runs the workload's data-parallel step (``worker parts``):
the fused step's median, its parts (forward and backward, the compressor
with and without its collectives, the optimizer, the host's dispatch) and
the same fused step on each worker's device alone, all workers in lockstep:
the compute-only step. The model predicts the step as the compute-only step
plus the step's compiled collectives on the idle link
(``predicted_step_s``); ``predicted_busy_step_s`` prices them on the busy
link instead, the hypothesis that a collective on busy cores pays a
scheduling latency per hop, which the measured steps do not bear out.

Compute-only is measured in lockstep because free-running lone processes
are not the cluster's compute when there are more workers than cores: they
contend for the cores in a way the lockstepped cluster workers do not.

``measure_hierarchical`` makes each process a node of several devices and
compares hierarchical compression (a dense mean within the node, the
compressor across nodes), the same with the model sharded within the node
(``acp_jax.ShardedDataParallel``), and flat compression over all devices.
"""

import importlib.util
import signal
import statistics
import sys
from typing import Any

from acp_jax_tools import costmodel
from benchmarks import cli
from benchmarks import cluster_nodes
from benchmarks import launch
from benchmarks import links
from benchmarks import records
from benchmarks import thresholds
from benchmarks import worker as worker_parts
from benchmarks import workloads

BANDWIDTHS = launch.BANDWIDTHS
TORCH = ("ssgd", "power_sgd")
# Their train step takes minutes to compile at 4 workers (Sign-SGD 212 s in
# one process here; four processes compile at once on 2 cores), so by
# default they run on the fastest link only, where the paper finds them
# losing to S-SGD.
FASTEST_LINK_ONLY = ("sign_sgd", "topk_sgd")
# A dense method's step is a whole model's all-reduce: bert_base_2l's 86 MB
# take about 7 s at 100 Mb/s and 70 s at 10 Mb/s between 2 workers. Below
# 1 Gb/s it runs this many steps, and below DENSE_MIN_MBIT none.
DENSE = ("ssgd",)
DENSE_SLOW_STEPS = 4
DENSE_MIN_MBIT = 100
# Untimed steps before the timed ones: the first compile each phase's
# program, and in the first dozen or so the allocator still faults in fresh
# pages for whole steps (measured: bursts of 60-85 thousand minor faults,
# 3-5x the step's median time, in both phases and in the compute-only step).
WARMUP = 10
PSUM_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
# The pass over memory before each busy all-reduce of the calibration: about
# as long as a part of the cluster workload's step.
BUSY_MB = 40


def _torch_args(
    model: str, compressor: str, steps: int, warmup: int
) -> list[str]:
  m = workloads.CLUSTER_MODELS[model]
  size = m["size"]
  return [
      "-m",
      "benchmarks.torch_peer",
      f"--compressor={compressor}",
      f"--rank={m['rank']}",
      f"--steps={steps}",
      f"--warmup={warmup}",
      f"--layers={size['num_layers']}",
      f"--hidden={size['hidden']}",
      f"--heads={size['heads']}",
      f"--ffn={size['ffn']}",
      f"--vocab_size={m['vocab_size']}",
      f"--seq_len={m['seq_len']}",
      f"--batch_size={m['batch_size']}",
  ]


def psum_sizes(rate_mbit: float | None) -> tuple[int, ...]:
  """The sizes of ``PSUM_SIZES`` that a link of ``rate_mbit`` (None:
  unshaped) moves in about a second at most: the calibration's 16 MiB take
  13 s at 10 Mb/s, and it times each size a dozen times."""
  if rate_mbit is None:
    return PSUM_SIZES
  return tuple(s for s in PSUM_SIZES if s * 8 <= rate_mbit * 1e6) or (
      PSUM_SIZES[:3]
  )


def calibrate(
    network: links.Network, timeout: float, sizes=PSUM_SIZES
) -> tuple[costmodel.Link, costmodel.Link, list[dict[str, Any]]]:
  """Fits alpha and beta to all-reduce times on ``network``, on idle
  workers and on busy ones; returns both links and a record per size of
  ``sizes``: the slowest worker's seconds, idle and busy, and the fitted
  links.

  *Busy* is the all-reduce's share of a program that first makes a pass
  over ``BUSY_MB`` of memory, every worker at once, as a train step's
  collectives follow its compute. On oversubscribed cores a ring's every
  hop then waits for its receiver to be scheduled: the latency the idle
  calibration does not see.
  """
  results = launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "psum",
          f"--sizes={','.join(map(str, sizes))}",
          f"--busy_mb={BUSY_MB}",
          *launch.distributed(network, i),
      ),
      timeout,
  )
  p = len(network.names)
  fitted, rows = [], [{"size_bytes": s} for s in sizes]
  for key in ("psum_seconds", "busy_psum_seconds"):
    seconds = [max(r[key][str(s)] for r in results) for s in sizes]
    link = costmodel.fit_all_reduce(sizes, seconds, p)
    fitted.append(link)
    prefix = "busy_" if key.startswith("busy") else ""
    for row, t in zip(rows, seconds):
      row.update(
          {
              f"{prefix}psum_seconds": t,
              f"{prefix}alpha_s": link.alpha,
              f"{prefix}beta_s_per_byte": link.beta,
          }
      )
  return fitted[0], fitted[1], rows


def predict(step_local: float, phases, workers: int, link) -> float:
  """The model's step: the compute-only step plus each phase's
  communication on ``link``, averaged over the phases. XLA:CPU runs a
  step's thunks in order, so nothing is hidden behind backprop."""
  return statistics.mean(
      step_local + costmodel.Traffic(**t).seconds(workers, link) for t in phases
  )


def _jax_run(network, model, name, steps, warmup, timeout, breakdown):
  """A run of compressor ``name`` on ``network`` (with ``breakdown``, and
  one more round that takes its step apart): each worker's result."""
  return launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "parts",
          f"--workload={model}",
          f"--compressor={name}",
          f"--steps={steps}",
          f"--warmup={warmup}",
          *(["--breakdown"] if breakdown else []),
          *launch.distributed(network, i),
      ),
      timeout,
  )


def _slowest(seconds: list[dict[str, float]], key: str) -> float:
  """``key`` of every worker's ``seconds`` on the slowest worker: a
  synchronous step waits for it."""
  return max(s[key] for s in seconds)


def _phase_seconds(workers) -> list[float]:
  """One round's fused step, its median per phase on the slowest worker;
  ``workers``: each worker's round."""
  phases = sorted({t["phase"] for t in workers[0]["trace"]})
  return [
      max(
          statistics.median(t["step_s"] for t in w["trace"] if t["phase"] == ph)
          for w in workers
      )
      for ph in phases
  ]


def _jax_record(results, model, idle, busy) -> dict[str, Any]:
  """One compressor's record from each worker's result (its rounds, and
  its breakdown where it ran): medians over the rounds, with their
  spreads."""
  workers = len(results)
  batch = workloads.CLUSTER_MODELS[model]["batch_size"] * workers
  rounds = [list(ws) for ws in zip(*(w["rounds"] for w in results))]
  seconds = lambda key: [
      _slowest([w["seconds"] for w in r], key) for r in rounds
  ]
  steps, local = seconds("step"), statistics.median(seconds("step_local"))
  step = statistics.median(steps)
  phases = results[0]["traffic"]
  predicted = predict(local, phases, workers, idle)
  record = {
      "system": "acp_jax",
      "repeats": len(rounds),
      **records.repeated("examples_per_sec", [batch / s for s in steps]),
      "compute_only_examples_per_sec": batch / local,
      "predicted_examples_per_sec": batch / predicted,
      **records.repeated("step_s", steps),
      "step_local_s": local,
      **{
          f"phase{k}_step_s": statistics.median(ph)
          for k, ph in enumerate(zip(*map(_phase_seconds, rounds)))
      },
      # Pages faulted in a fused step, the median on each worker, then the
      # largest: whether the allocator still maps memory afresh.
      "step_minflt": max(
          statistics.median(
              t["minflt"] for r in w["rounds"] for t in r["trace"]
          )
          for w in results
      ),
      "predicted_step_s": predicted,
      "predicted_busy_step_s": predict(local, phases, workers, busy),
      "error_pct": 100 * (predicted - step) / step,
      "dispatch_s": statistics.median(seconds("dispatch")),
      "bytes_per_step": statistics.mean(
          t["all_reduce"] + t["all_gather"] / workers for t in phases
      ),
      "params_identical": len({w["params_sha256"] for w in results}) == 1,
  }
  if "breakdown" in results[0]:
    parts = [w["breakdown"] for w in results]
    record.update(
        {f"{k}_s": _slowest(parts, k) for k in worker_parts.BREAKDOWN}
    )
  return record


def _torch_run(network, model, name, steps, warmup, timeout):
  return launch.on_network(
      network,
      lambda i: [sys.executable]
      + _torch_args(model, name, warmup + steps, warmup)
      + launch.torch_distributed(network, i),
      timeout,
  )


def _torch_record(reps) -> dict[str, Any]:
  return {
      "system": "torch",
      "repeats": len(reps),
      **records.repeated(
          "examples_per_sec", [r[0]["examples_per_sec"] for r in reps]
      ),
      "params_identical": all(
          len({w["params_sha256"] for w in r}) == 1 for r in reps
      ),
  }


def runs_on(bandwidth: str, name: str) -> int | None:
  """Steps a dense method takes on ``bandwidth``: each is a whole model's
  all-reduce, so on slow links it runs fewer (``DENSE_SLOW_STEPS``), and
  below ``DENSE_MIN_MBIT`` none (None); the others run every step asked."""
  rate = BANDWIDTHS[bandwidth]
  if name not in DENSE or rate is None or rate >= 1000:
    return 0
  return None if rate < DENSE_MIN_MBIT else DENSE_SLOW_STEPS


def _methods(compressors, torch, bandwidth, last, fastest_link_only):
  """(system, compressor) of every run on ``bandwidth``."""
  jax = [
      ("acp_jax", c)
      for c in compressors
      if (last or c not in fastest_link_only)
      and runs_on(bandwidth, c) is not None
  ]
  # The hook's first steps all-reduce the whole model, as DDP's every step
  # does: below DENSE_MIN_MBIT no PyTorch method runs.
  return jax + [
      ("torch", c) for c in torch if runs_on(bandwidth, "ssgd") is not None
  ]


def run_steps(system: str, name: str, bandwidth: str, steps: int, warmup: int):
  """(timed, untimed) steps of a run of ``name`` on ``bandwidth``: fewer
  for a dense method on a slow link (``runs_on``), and at least the three
  untimed steps the PyTorch peer needs."""
  slow = runs_on(bandwidth, name)
  timed, untimed = (slow, 0) if slow else (steps, warmup)
  return timed, max(untimed, 3) if system == "torch" else untimed


def _measure_link(
    network,
    model,
    methods,
    bandwidth,
    steps,
    warmup,
    repeats,
    breakdown,
    timeout,
    failures,
):
  """Every run of ``methods`` on one link, in ``repeats`` rounds: a run of
  each method per round, so that a slow stretch of the machine falls on
  all of them alike. A run is its own processes: a worker holding two
  compressors' programs and states at once takes 4.3 GB here, too much for
  4 workers. The last round also takes the JAX steps apart, if
  ``breakdown``. Returns each method's results, a list per round."""
  results = {m: [] for m in methods}
  p = len(network.names)
  for rep in range(repeats):
    for system, name in methods:
      n, w = run_steps(system, name, bandwidth, steps, warmup)
      if system == "acp_jax":
        last = breakdown and rep == repeats - 1
        run = lambda: _jax_run(network, model, name, n, w, timeout, last)
      else:
        run = lambda: _torch_run(network, model, name, n, w, timeout)
      what = f"{p} workers {bandwidth} {system} {name} round {rep + 1}"
      out = launch.attempt(failures, what, run)
      if out is not None:
        results[system, name].append(out)
  return results


def measure(
    model: str,
    workers: list[int],
    bandwidths: list[str],
    steps: int,
    timeout: float,
    torch=TORCH,
    compressors=workloads.COMPRESSORS,
    fastest_link_only=FASTEST_LINK_ONLY,
    repeats: int = 3,
    warmup: int = WARMUP,
    breakdown_links=(thresholds.SLOW_LINK,),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
  """Cluster records (one per worker count, bandwidth, system and
  compressor), link calibration records (one per worker count, bandwidth
  and psum size) and the runs that failed, each with its reason. The
  ``fastest_link_only`` compressors run on the last bandwidth only.

  On each link every method runs ``repeats`` times, interleaved
  (``_measure_link``); a record holds the median over its runs and their
  spread. On ``breakdown_links`` the JAX methods' last round also takes
  their steps apart. The links come from ``launch.each_link``, one
  compilation cache for all.
  """
  runs, calibration, failures = [], [], []
  for p, bandwidth, network in launch.each_link(workers, bandwidths):
    rate = BANDWIDTHS[bandwidth]
    idle, busy, rows = calibrate(network, timeout, psum_sizes(rate))
    print(
        f"{p} workers, {bandwidth}: alpha {idle.alpha * 1e6:.0f} us"
        f" idle, {busy.alpha * 1e6:.0f} us busy; beta"
        f" {1 / idle.beta / 1e6:.0f} MB/s idle,"
        f" {1 / busy.beta / 1e6:.0f} MB/s busy",
        flush=True,
    )
    base = {"bandwidth": bandwidth, "workers": p, "model": model}
    calibration.extend({**base, **row} for row in rows)
    methods = _methods(
        compressors,
        torch,
        bandwidth,
        bandwidth == bandwidths[-1],
        fastest_link_only,
    )
    results = _measure_link(
        network,
        model,
        methods,
        bandwidth,
        steps,
        warmup,
        repeats,
        bandwidth in breakdown_links,
        timeout,
        failures,
    )
    for (system, name), reps in results.items():
      if not reps:
        continue
      if system == "torch":
        record = _torch_record(reps)
      else:
        # Each worker's result, its rounds gathered.
        record = _jax_record(
            [
                {**ws[-1], "rounds": [w["rounds"][0] for w in ws]}
                for ws in zip(*reps)
            ],
            model,
            idle,
            busy,
        )
      n, w = run_steps(system, name, bandwidth, steps, warmup)
      runs.append({
          **base,
          "compressor": name,
          "timed_steps": n,
          "warmup_steps": w,
          **record,
      })
      _show(runs[-1])
  return runs, calibration, failures


def _show(run: dict[str, Any]) -> None:
  predicted = run.get("predicted_examples_per_sec")
  extra = f" (model: {predicted:.2f})" if predicted else ""
  print(
      f"  {run['system']} {run['compressor']}:"
      f" {run['examples_per_sec']:.2f} examples/s{extra}",
      flush=True,
  )


COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "system": "system",
    "compressor": "compressor",
    "examples_per_sec": "examples/s",
    "examples_per_sec_min": "min",
    "examples_per_sec_max": "max",
    "predicted_examples_per_sec": "model",
    "compute_only_examples_per_sec": "compute only",
    "error_pct": "model error, %",
    "step_minflt": "faults",
    "params_identical": "same params",
}

HELP = "worker processes on shaped network links (needs root)"

# Each run's counts: their least value, meaning, and defaults without and
# with --quick.
_RUN_FLAGS = {
    "steps": (4, "timed train steps per run", 30, 4),
    "warmup": (0, "untimed steps before them", WARMUP, 0),
    "repeats": (1, "runs of each method per link, interleaved", 3, 1),
}


def _run_setting(args, name: str) -> int:
  """``--name``, or its default for a full or a ``--quick`` run."""
  value = getattr(args, name)
  _, _, default, quick = _RUN_FLAGS[name]
  return (quick if args.quick else default) if value is None else value


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--workers",
      type=cli.ints_at_least(2),
      help="comma-separated worker counts (default: 2,4; with"
      " --hierarchical, one count, default 2)",
  )
  parser.add_argument(
      "--model",
      default="bert_base_2l",
      choices=tuple(workloads.CLUSTER_MODELS),
      help="a cluster model of benchmarks/workloads.py",
  )
  parser.add_argument(
      "--bandwidths",
      type=cli.names(tuple(BANDWIDTHS), "bandwidth"),
      default="10mbit,100mbit,1gbit,10gbit,unshaped",
      help=f"comma-separated, of {', '.join(BANDWIDTHS)}",
  )
  for name, (low, what, default, quick) in _RUN_FLAGS.items():
    parser.add_argument(
        f"--{name}",
        type=cli.int_at_least(low),
        help=f"{what} (default {default}; --quick {quick})",
    )
  parser.add_argument(
      "--breakdown_links",
      type=cli.names(tuple(BANDWIDTHS), "bandwidth"),
      default=thresholds.SLOW_LINK,
      help="links on which one more run takes each step apart",
  )
  parser.add_argument(
      "--compressors",
      type=cli.names(workloads.COMPRESSORS, "compressor"),
      help="comma-separated (default: all five)",
  )
  parser.add_argument(
      "--timeout", type=float, default=900, help="seconds per run"
  )
  parser.add_argument(
      "--no_torch", action="store_true", help="skip the PyTorch peer"
  )
  parser.add_argument(
      "--torch_compressors",
      type=cli.names(TORCH, "PyTorch method"),
      default=",".join(TORCH),
      help="the PyTorch peer's methods: ssgd (DDP), power_sgd (its hook)",
  )
  parser.add_argument(
      "--hierarchical",
      action="store_true",
      help="each worker a node of --devices_per_worker devices: hierarchical"
      " ACP-SGD, and the same with the model sharded within a node, against"
      " flat ACP-SGD and S-SGD",
  )
  parser.add_argument(
      "--devices_per_worker", type=cli.int_at_least(1), default=2
  )


def main(args) -> None:
  reason = links.unavailable()
  if reason:
    print(f"cluster: skipped, {reason}")
    return
  meta = cli.start(args, 1)  # each worker is a process of its own devices
  workers = args.workers or ([2] if args.hierarchical else [2, 4])
  if args.hierarchical and len(workers) != 1:
    raise SystemExit(
        f"--workers: --hierarchical takes one count, got {args.workers}"
    )
  steps = _run_setting(args, "steps")
  # A SIGTERM unwinds like an error, so the links come down.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if args.hierarchical:
    runs, failures = cluster_nodes.measure_hierarchical(
        args.model,
        workers[0],
        args.devices_per_worker,
        args.bandwidths,
        steps,
        args.timeout,
    )
    outputs = {"cluster_hierarchical": runs}
    cli.finish(args, meta, outputs, runs, cluster_nodes.COLUMNS, failures)
    return
  torch = not args.no_torch and importlib.util.find_spec("torch") is not None
  if not torch and not args.no_torch:
    print("cluster: torch is not installed, the PyTorch peer is skipped")
  runs, calibration, failures = measure(
      args.model,
      workers,
      args.bandwidths,
      steps,
      args.timeout,
      args.torch_compressors if torch else (),
      args.compressors or workloads.COMPRESSORS,
      # Asked for by name, they run on every link.
      () if args.compressors else FASTEST_LINK_ONLY,
      repeats=_run_setting(args, "repeats"),
      warmup=_run_setting(args, "warmup"),
      breakdown_links=args.breakdown_links,
  )
  outputs = {"cluster": runs, "cluster_links": calibration}
  cli.finish(args, meta, outputs, runs, COLUMNS, failures)
