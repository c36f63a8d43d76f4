"""The overlapped step against the fused one, across a shaped link.

  python -m benchmarks overlap_step [--workers 2] [--bandwidths 100mbit]
      [--compressors ssgd,power_sgd,acp_sgd] [--steps 6] [--rounds 3]

On each link (``benchmarks/links.py``: one namespace per worker on a
switch), each compressor trains the cluster workload with
``acp_jax.DataParallel.step`` fused and overlapped, one worker process per
namespace (``worker overlap``). The two steps alternate round by round
within one run, which goes first alternating too, so that each round's
ratio compares steps taken minutes apart at most; the compute-only step
(the fused step on each worker's device alone, in lockstep) is timed in
every round beside them. A record holds each round's medians on the slowest
worker, their median and their range, and the ratio fused / overlapped of
every round.
"""

from typing import Any

from benchmarks import cli
from benchmarks import launch
from benchmarks import links
from benchmarks import records
from benchmarks import worker as worker_lib
from benchmarks import workloads

HELP = "the overlapped step against the fused one, on shaped links"
MODES = (*worker_lib.OVERLAP_MODES, "local")
COLUMNS = {
    "workers": "workers",
    "bandwidth": "link",
    "compressor": "method",
    "fused_s": "fused s",
    "overlapped_s": "overlapped s",
    "local_s": "compute-only s",
    "speedup": "fused / overlapped (median)",
    "speedup_min": "min",
    "speedup_max": "max",
}


def _run(network, model, name, steps, rounds, timeout) -> list[dict]:
  return launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "overlap",
          f"--workload={model}",
          f"--compressor={name}",
          f"--steps={steps}",
          f"--rounds={rounds}",
          *launch.distributed(network, i),
      ),
      timeout,
  )


def record(results: list[dict]) -> dict[str, Any]:
  """One run's record from each worker's result: per round, each mode's
  median on the slowest worker (a synchronous step waits for it)."""
  rounds = [
      {m: max(w["rounds"][r][m] for w in results) for m in MODES}
      for r in range(len(results[0]["rounds"]))
  ]
  out = {}
  for m in MODES:
    out.update(records.repeated(f"{m}_s", [r[m] for r in rounds]))
  out.update(
      records.repeated(
          "speedup", [r["fused"] / r["overlapped"] for r in rounds]
      )
  )
  out["exchange_order"] = ",".join(map(str, results[0]["exchange_order"]))
  return out


def measure(
    model: str,
    workers: list[int],
    bandwidths: list[str],
    compressors: list[str],
    steps: int,
    rounds: int,
    timeout: float,
) -> tuple[list[dict[str, Any]], list[str]]:
  rows, failures = [], []
  for p, bandwidth, network in launch.each_link(workers, bandwidths):
    for name in compressors:
      what = f"{name}, {p} workers, {bandwidth}"
      results = launch.attempt(
          failures,
          what,
          lambda: _run(network, model, name, steps, rounds, timeout),
      )
      if results is None:
        continue
      rows.append({
          "model": model,
          "workers": p,
          "bandwidth": bandwidth,
          "compressor": name,
          "timed_steps": steps,
          **record(results),
      })
      print(
          f"{what}: fused {rows[-1]['fused_s']:.3f} s, overlapped"
          f" {rows[-1]['overlapped_s']:.3f} s, compute-only"
          f" {rows[-1]['local_s']:.3f} s",
          flush=True,
      )
  return rows, failures


def add_arguments(parser) -> None:
  cli.add_quick(parser)
  parser.add_argument(
      "--model", default="bert_base_2l", choices=sorted(workloads.CLUSTER_MODELS)
  )
  parser.add_argument("--workers", type=cli.ints_at_least(2), default=[2])
  parser.add_argument(
      "--bandwidths",
      type=cli.names(list(launch.BANDWIDTHS), "bandwidth"),
      default=["100mbit"],
  )
  parser.add_argument(
      "--compressors",
      type=cli.names(list(workloads.COMPRESSORS), "compressor"),
      default=["ssgd", "power_sgd", "acp_sgd"],
  )
  parser.add_argument("--steps", type=cli.int_at_least(1), default=6)
  parser.add_argument("--rounds", type=cli.int_at_least(1), default=3)
  parser.add_argument(
      "--timeout", type=float, default=1800, help="seconds per run"
  )


def main(args) -> None:
  reason = links.unavailable()
  if reason:
    print(f"overlap_step: skipped, {reason}")
    return
  meta = cli.start(args, None)
  model = "tiny" if args.quick else args.model
  rows, failures = measure(
      model,
      args.workers,
      args.bandwidths,
      args.compressors,
      args.steps,
      args.rounds,
      args.timeout,
  )
  cli.finish(args, meta, {"overlap_step": rows}, rows, COLUMNS, failures)
