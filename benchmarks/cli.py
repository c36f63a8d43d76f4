"""What the subcommands of ``python -m benchmarks`` share: argument types
that refuse a bad value with the flag's name, and the start and end of every
measuring subcommand (JAX set up and the run's provenance taken; its records
written with it, a table printed).

A subcommand is a module of this package that defines ``HELP`` (one line for
``--help``), ``add_arguments(parser)`` and ``main(args)``; ``args`` holds the
parsed flags of the command line and the command line itself, as
``args.argv``.
"""

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import records
from benchmarks import workloads
from train import runtime


def add_quick(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--quick", action="store_true", help="a run of a minute or two"
  )


def int_at_least(low: int) -> Callable[[str], int]:
  """An argparse type: an int of at least ``low``."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"must be an int, got {text!r}"
      ) from None
    if value < low:
      raise argparse.ArgumentTypeError(
          f"must be at least {low}, got {value}"
      )
    return value

  return parse


def ints_at_least(low: int) -> Callable[[str], list[int]]:
  """An argparse type: comma-separated ints, each of at least ``low``."""
  one = int_at_least(low)

  def parse(text: str) -> list[int]:
    try:
      return [one(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
      raise argparse.ArgumentTypeError(
          f"must be comma-separated ints of at least {low}, got {text!r}"
      ) from None

  return parse


def names(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
  """An argparse type: comma-separated names out of ``known`` ('' for
  none)."""

  def parse(text: str) -> list[str]:
    chosen = [name for name in text.split(",") if name]
    for name in chosen:
      if name not in known:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {name!r}; choose from {', '.join(known)}"
        )
    return chosen

  return parse


WORKLOADS = names(tuple(workloads.WORKLOADS), "workload")


def add_models(
    parser: argparse.ArgumentParser, help: str = "comma-separated workloads"
) -> None:
  parser.add_argument("--models", type=WORKLOADS, help=help)


def default_models(args, skip: tuple[str, ...] = ()) -> list[str]:
  """``--models``, or without it the workloads of a full or ``--quick`` run
  less ``skip``."""
  if args.models is not None:
    return args.models
  models = workloads.SMALL if args.quick else workloads.WORKLOADS
  return [m for m in models if m not in skip]


def start(args, num_cpu_devices: int | None) -> dict[str, Any]:
  """Sets JAX up on ``num_cpu_devices`` simulated CPU devices (None: its
  default platform, as it is) and returns the run's machine, date and
  command, as record fields."""
  if num_cpu_devices is not None:
    runtime.setup(num_cpu_devices=num_cpu_devices)
  return {**records.provenance(args.argv), "quick": args.quick}


def finish(
    args,
    meta: dict[str, Any],
    outputs: dict[str, list[dict[str, Any]]],
    rows: list[dict[str, Any]],
    columns: dict[str, str],
    failures: Sequence[str] = (),
) -> None:
  """Writes each of ``outputs`` (record file name -> records) into
  ``--results_dir`` with ``meta`` (from ``start``); prints ``rows`` as a
  table; then fails, naming ``failures``, if any run failed."""
  for name, out in outputs.items():
    path = records.write(name, [{**r, **meta} for r in out], args.results_dir)
    print(f"wrote {path}")
  print(records.table(rows, columns))
  if failures:
    raise SystemExit("runs that failed:\n" + "\n".join(failures))
