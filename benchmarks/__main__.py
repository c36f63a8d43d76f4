"""``python -m benchmarks [--results_dir DIR] SUBCOMMAND [--quick] ...``.

The parser is built from the subcommands' modules (``benchmarks.SUBCOMMANDS``,
each declaring its arguments and its ``main``), and the one named on the
command line runs.
"""

import argparse
import importlib
import signal
import sys

import benchmarks
from benchmarks import records


def parser() -> argparse.ArgumentParser:
  """Every subcommand's flags, after the flags they share."""
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
  for name in benchmarks.SUBCOMMANDS:
    module = importlib.import_module(f"benchmarks.{name}")
    command = sub.add_parser(name, help=module.HELP)
    module.add_arguments(command)
    command.set_defaults(main=module.main)
  return parser


def _exit_on_sigterm(signum, frame) -> None:
  """SIGTERM as an exit: the ``finally`` blocks that stop the workers and
  delete the network namespaces run, as they do on Ctrl-C."""
  del frame
  raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
  signal.signal(signal.SIGTERM, _exit_on_sigterm)
  argv = sys.argv[1:] if argv is None else argv
  args = parser().parse_args(argv)
  args.argv = argv
  args.main(args)


if __name__ == "__main__":
  main()
