"""``python -m benchmarks SUBCOMMAND [--quick]``: comm, overhead, convergence,
cluster, project, sign_scaling, gpu, pipeline, report.

Each measuring subcommand prints a table and writes
``benchmarks/results/SUBCOMMAND.json`` (``comm`` also ``overlap.json``), a
list of flat records that carry the machine, date and command; ``report``
turns them into ``benchmarks/results/REPORT.md`` with plots.
"""

import argparse
import os
import importlib.util
import signal
import sys
import time

from benchmarks import records


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks")
  parser.add_argument(
      "--results_dir",
      default=str(records.RESULTS_DIR),
      help="where the JSON files and the report go (default: %(default)s)",
  )
  parser.add_argument(
      "--num_cpu_devices",
      type=int,
      default=8,
      help="simulated CPU devices (comm, convergence)",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  quick = argparse.ArgumentParser(add_help=False)
  quick.add_argument(
      "--quick", action="store_true", help="a run of a minute or two"
  )
  comm = sub.add_parser(
      "comm", parents=[quick], help="bytes and collectives per step"
  )
  comm.add_argument("--models", help="comma-separated workloads")
  comm.add_argument(
      "--overlap_models",
      help="comma-separated workloads whose whole train step is compiled for"
      " its overlap with backprop, '' for none (default: resnet50,bert_base;"
      " small_cnn with --quick)",
  )
  overhead = sub.add_parser(
      "overhead", parents=[quick], help="compute each compressor adds"
  )
  overhead.add_argument("--models", help="comma-separated workloads")
  overhead.add_argument("--repeats", type=int, help="timed calls per update")
  convergence = sub.add_parser(
      "convergence",
      parents=[quick],
      help="the compressors trained, at equal rank and bytes, several seeds",
  )
  convergence.add_argument(
      "--mnist_path",
      help="folder of MNIST IDX files (needed by the mnist task)",
  )
  convergence.add_argument(
      "--tasks",
      default="char_lm_long,char_lm_sgd,char_lm,mnist",
      help="comma-separated tasks, run in this order (default: %(default)s)",
  )
  convergence.add_argument(
      "--variants",
      help="comma-separated variants to run, in this order, of those each"
      " task runs (default: all of them)",
  )
  convergence.add_argument(
      "--char_lm_path",
      help="plain-text file, e.g. tiny-shakespeare (needed by the char_lm"
      " task)",
  )
  cluster = sub.add_parser(
      "cluster",
      parents=[quick],
      help="worker processes on shaped network links (needs root)",
  )
  cluster.add_argument(
      "--workers",
      help="comma-separated worker counts (default: 2,4; with"
      " --hierarchical, one count, default 2)",
  )
  cluster.add_argument(
      "--model",
      default="bert_base_2l",
      help="a cluster model of benchmarks/workloads.py",
  )
  cluster.add_argument(
      "--bandwidths",
      default="1gbit,10gbit,unshaped",
      help="comma-separated, of 1gbit, 10gbit, unshaped",
  )
  cluster.add_argument("--steps", type=int, help="train steps per run")
  cluster.add_argument(
      "--compressors", help="comma-separated (default: all five)"
  )
  cluster.add_argument(
      "--timeout", type=float, default=900, help="seconds per run"
  )
  cluster.add_argument(
      "--no_torch", action="store_true", help="skip the PyTorch peer"
  )
  cluster.add_argument(
      "--hierarchical",
      action="store_true",
      help="each worker a node of --devices_per_worker devices: hierarchical"
      " ACP-SGD against flat ACP-SGD and S-SGD",
  )
  cluster.add_argument("--devices_per_worker", type=int, default=2)
  project = sub.add_parser(
      "project",
      parents=[quick],
      help="the cost model at 8-64 workers and 1-100 Gb/s",
  )
  project.add_argument("--models", help="comma-separated workloads")
  project.add_argument(
      "--alpha_us",
      type=float,
      help="link latency (default: calibrated by cluster, unshaped link)",
  )
  sign_scaling = sub.add_parser(
      "sign_scaling",
      parents=[quick],
      help="Sign-SGD's update time at 1 to 8 devices, against S-SGD",
  )
  sign_scaling.add_argument(
      "--devices",
      help="comma-separated device counts (default: 1,2,4,8; 1,2 if --quick)",
  )
  sign_scaling.add_argument("--repeats", type=int, help="timed calls per run")
  sign_scaling.add_argument(
      "--timeout", type=float, default=600, help="seconds per run"
  )
  gpu = sub.add_parser(
      "gpu",
      parents=[quick],
      help="compute times and the scheduled 8-GPU step, on a GPU (skips"
      " without one)",
  )
  gpu.add_argument(
      "--models", help="comma-separated workloads (default: resnet50,bert_base)"
  )
  sub.add_parser(
      "pipeline",
      parents=[quick],
      help="images/s of the input pipeline at 0-2 workers, beside the train"
      " step's",
  )
  sub.add_parser("report", help="REPORT.md with tables and plots")
  return parser


def _models(
    arg: str | None, quick: bool, skip: tuple[str, ...] = ()
) -> list[str]:
  from benchmarks import workloads

  if arg is None:
    models = workloads.SMALL if quick else workloads.WORKLOADS
    return [m for m in models if m not in skip]
  models = arg.split(",")
  for model in models:
    if model not in workloads.WORKLOADS:
      raise SystemExit(
          f"--models: unknown workload {model!r}; choose from"
          f" {', '.join(workloads.WORKLOADS)}"
      )
  return models


def _cluster(args, cluster):
  from benchmarks import workloads

  bandwidths = args.bandwidths.split(",")
  for bandwidth in bandwidths:
    if bandwidth not in cluster.BANDWIDTHS:
      raise SystemExit(
          f"--bandwidths: unknown {bandwidth!r}; choose from"
          f" {', '.join(cluster.BANDWIDTHS)}"
      )
  if args.model not in workloads.CLUSTER_MODELS:
    raise SystemExit(
        f"--model: unknown {args.model!r}; choose from"
        f" {', '.join(workloads.CLUSTER_MODELS)}"
    )
  known = workloads.COMPRESSORS
  compressors = args.compressors.split(",") if args.compressors else known
  for name in compressors:
    if name not in known:
      raise SystemExit(
          f"--compressors: unknown {name!r}; choose from {', '.join(known)}"
      )
  default = "2" if args.hierarchical else "2,4"
  try:
    workers = [int(w) for w in (args.workers or default).split(",")]
  except ValueError:
    raise SystemExit(
        f"--workers must be comma-separated integers, got {args.workers!r}"
    ) from None
  if min(workers) < 2:
    raise SystemExit(f"--workers must be at least 2, got {args.workers}")
  if args.hierarchical and len(workers) != 1:
    raise SystemExit(
        f"--workers: --hierarchical takes one count, got {args.workers}"
    )
  steps = args.steps or (6 if args.quick else 10)
  if steps < 4:
    raise SystemExit(f"--steps must be at least 4, got {steps}")
  # A SIGTERM unwinds like an error, so the links come down.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if args.hierarchical:
    if args.devices_per_worker < 1:
      raise SystemExit(
          "--devices_per_worker must be positive, got"
          f" {args.devices_per_worker}"
      )
    runs, failures = cluster.measure_hierarchical(
        args.model,
        workers[0],
        args.devices_per_worker,
        bandwidths,
        steps,
        args.timeout,
    )
    return (
        {"cluster_hierarchical": runs},
        cluster.HIERARCHICAL_COLUMNS,
        failures,
    )
  torch = not args.no_torch and importlib.util.find_spec("torch") is not None
  if not torch and not args.no_torch:
    print("cluster: torch is not installed, the PyTorch peer is skipped")
  runs, calibration, failures = cluster.measure(
      args.model,
      workers,
      bandwidths,
      steps,
      args.timeout,
      torch,
      compressors,
      # Asked for by name, they run on every link.
      () if args.compressors else cluster.FASTEST_LINK_ONLY,
  )
  return (
      {"cluster": runs, "cluster_links": calibration},
      cluster.COLUMNS,
      failures,
  )


def _project(args, project):
  from benchmarks import workloads

  models = _models(args.models, False) if args.models else list(workloads.PAPER)
  alpha = args.alpha_us
  links = records.read("cluster_links", args.results_dir)
  if alpha is None:
    calibrated = [r for r in links if r["bandwidth"] == "unshaped"]
    if not calibrated:
      raise SystemExit(
          "project: no unshaped link calibration in"
          f" {args.results_dir}/cluster_links.json; run `python -m"
          " benchmarks cluster` first or pass --alpha_us"
      )
    alpha = calibrated[0]["alpha_s"]
  else:
    if alpha < 0:
      raise SystemExit(f"--alpha_us must be >= 0, got {alpha}")
    alpha *= 1e-6
  repeats = 2 if args.quick else 5
  rows = project.measure(
      models,
      alpha,
      (2, 4),
      repeats,
      records.read("overhead", args.results_dir),
      records.read("gpu", args.results_dir),
  )
  return rows + project.validation(records.read("cluster", args.results_dir))


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = _parser().parse_args(argv)
  if args.command == "report":
    from benchmarks import report

    print(report.write(args.results_dir))
    return

  if args.command == "cluster":
    from benchmarks import links

    reason = links.unavailable()
    if reason:
      print(f"cluster: skipped, {reason}")
      return
  if args.command == "gpu":
    from benchmarks import gpu

    reason = gpu.unavailable()
    if reason:
      print(f"gpu: skipped, {reason}")
      return
  from train import runtime

  # The cluster's workers and sign_scaling's runs are processes of their
  # own device counts.
  devices = {
      "cluster": 1,
      "project": 1,
      "sign_scaling": 1,
  }.get(args.command)
  if args.command != "gpu":  # the GPU check runs on the GPU
    runtime.setup(num_cpu_devices=devices or args.num_cpu_devices)
  from benchmarks import cluster, comm, convergence, gpu, overhead, project
  from benchmarks import pipeline, sign_scaling

  meta = {**records.provenance(argv), "quick": args.quick}
  failures = []
  if args.command == "cluster":
    outputs, columns, failures = _cluster(args, cluster)
    rows = outputs["cluster_hierarchical" if args.hierarchical else "cluster"]
  elif args.command == "project":
    projected = _project(args, project)
    outputs = {"projection": projected}
    # Hundreds of projected rows: the averages and the checks print.
    rows = project.averages(
        [r for r in projected if r["kind"] == "projection"]
    ) + [r for r in projected if r["kind"] == "cluster"]
    columns = project.COLUMNS
  elif args.command == "comm":
    rows = comm.measure(_models(args.models, args.quick))
    columns, outputs = comm.COLUMNS, {"comm": rows}
    overlap_models = args.overlap_models
    if overlap_models is None:
      overlap_models = "small_cnn" if args.quick else ",".join(
          comm.OVERLAP_MODELS
      )
    if overlap_models:
      start = time.perf_counter()
      outputs["overlap"] = comm.overlap(_models(overlap_models, args.quick))
      print(records.table(outputs["overlap"], comm.OVERLAP_COLUMNS))
      print(f"overlap: compiled in {time.perf_counter() - start:.0f} s")
  elif args.command == "sign_scaling":
    counts = args.devices or ("1,2" if args.quick else "1,2,4,8")
    try:
      device_counts = [int(n) for n in counts.split(",")]
    except ValueError:
      raise SystemExit(
          f"--devices must be comma-separated ints, got {counts!r}"
      ) from None
    if any(n < 1 for n in device_counts):
      raise SystemExit(f"--devices must be positive, got {counts!r}")
    repeats = args.repeats or (2 if args.quick else 5)
    if repeats < 1:
      raise SystemExit(f"--repeats must be positive, got {repeats}")
    rows = sign_scaling.measure(device_counts, repeats, args.timeout)
    columns, outputs = sign_scaling.COLUMNS, {"sign_scaling": rows}
  elif args.command == "gpu":
    models = _models(args.models or ",".join(gpu.MODELS), False)
    outputs = {"gpu": gpu.measure(models, args.quick)}
    rows, columns = gpu.summary(outputs["gpu"]), gpu.COLUMNS
  elif args.command == "pipeline":
    rows = pipeline.measure(args.quick)
    columns, outputs = pipeline.COLUMNS, {"pipeline": rows}
  elif args.command == "overhead":
    repeats = args.repeats or (3 if args.quick else 10)
    if repeats < 1:
      raise SystemExit(f"--repeats must be positive, got {repeats}")
    # BERT-Large's five compressor states and top-k's sort space outgrow
    # 24 GB; ask for it with --models where there is more memory.
    models = _models(args.models, args.quick, skip=("bert_large",))
    rows = overhead.measure(models, repeats)
    columns, outputs = overhead.COLUMNS, {"overhead": rows}
  else:
    data = {"mnist": args.mnist_path, "tinyshakespeare": args.char_lm_path}
    for task in args.tasks.split(","):
      if task not in convergence.TASKS:
        raise SystemExit(
            f"--tasks: unknown task {task!r}; choose from"
            f" {', '.join(convergence.TASKS)}"
        )
    paths = {
        t: data[convergence.config_name(t)] for t in args.tasks.split(",")
    }
    os.makedirs(args.results_dir, exist_ok=True)
    log_path = os.path.join(args.results_dir, "convergence_runs.partial.jsonl")
    try:
      finals, curves = convergence.measure(
          paths,
          args.quick,
          log_path,
          args.variants.split(",") if args.variants else None,
      )
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: {e}") from None
    rows = convergence.summarize(finals, curves)
    columns = convergence.COLUMNS
    outputs = {"convergence": finals, "convergence_curves": curves}
  for name, out in outputs.items():
    path = records.write(name, [{**r, **meta} for r in out], args.results_dir)
    print(f"wrote {path}")
  if args.command == "convergence" and os.path.exists(log_path):
    os.remove(log_path)  # every run is in the records now
  print(records.table(rows, columns))
  if failures:
    raise SystemExit("runs that failed:\n" + "\n".join(failures))


if __name__ == "__main__":
  main()
