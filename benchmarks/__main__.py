"""``python -m benchmarks {comm,overhead,convergence,report} [--quick]``.

Each measuring subcommand prints a table and writes
``benchmarks/results/SUBCOMMAND.json``, a list of flat records that carry
the machine, date and command; ``report`` turns them into
``benchmarks/results/REPORT.md`` with plots.
"""

import argparse
import pathlib
import sys

from benchmarks import records

_SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


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
  overhead = sub.add_parser(
      "overhead", parents=[quick], help="compute each compressor adds"
  )
  overhead.add_argument("--models", help="comma-separated workloads")
  overhead.add_argument("--repeats", type=int, help="timed calls per update")
  convergence = sub.add_parser(
      "convergence", parents=[quick], help="the five methods trained"
  )
  convergence.add_argument(
      "--mnist_path",
      default=str(_SHARED / "mnist-t10k"),
      help="folder of MNIST IDX files (default: %(default)s)",
  )
  convergence.add_argument(
      "--char_lm_path",
      default=str(_SHARED / "tinyshakespeare" / "input.txt"),
      help="plain-text file for the char LM (default: %(default)s)",
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


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = _parser().parse_args(argv)
  if args.command == "report":
    from benchmarks import report

    print(report.write(args.results_dir))
    return

  from train import runtime

  runtime.setup(num_cpu_devices=args.num_cpu_devices)
  from benchmarks import comm, convergence, overhead

  meta = {**records.provenance(argv), "quick": args.quick}
  if args.command == "comm":
    rows = comm.measure(_models(args.models, args.quick))
    columns, outputs = comm.COLUMNS, {"comm": rows}
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
    paths = {"mnist": args.mnist_path, "char_lm": args.char_lm_path}
    try:
      rows, curves = convergence.measure(paths, args.quick)
    except FileNotFoundError as e:
      raise SystemExit(f"error: {e}") from None
    columns = convergence.COLUMNS
    outputs = {"convergence": rows, "convergence_curves": curves}
  for name, out in outputs.items():
    path = records.write(name, [{**r, **meta} for r in out], args.results_dir)
    print(f"wrote {path}")
  print(records.table(rows, columns))


if __name__ == "__main__":
  main()
