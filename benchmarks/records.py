"""Results as lists of flat records: where they live, what they carry, and
how they print.

Every record carries the machine, the date, the commit and the command that
made it, so a table in the report can say where its numbers come from.
"""

import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax

RESULTS_DIR = pathlib.Path(__file__).parent / "results"


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def commit() -> str:
  """The repository's commit, with ``+changes`` where its code differs from
  it (the results folder aside, which runs write into); ``unknown`` outside
  a git checkout."""
  root = RESULTS_DIR.parents[1]
  git = lambda *args: subprocess.run(
      ["git", *args], cwd=root, capture_output=True, text=True, check=False
  )
  head = git("rev-parse", "--short=12", "HEAD")
  if head.returncode != 0:
    return "unknown"
  changed = git(
      "status", "--porcelain", "--untracked-files=no", "--", ".",
      f":(exclude){RESULTS_DIR.relative_to(root)}",
  ).stdout.strip()
  return head.stdout.strip() + ("+changes" if changed else "")


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """The machine, date, commit and command of this run, as record
  fields."""
  argv = sys.argv[1:] if argv is None else argv
  device = jax.devices()[0]
  accelerator = "" if device.platform == "cpu" else f", {device.device_kind}"
  return {
      "machine": (
          f"{_cpu_name()} ({os.cpu_count()} cores){accelerator},"
          f" jax {jax.__version__}, {jax.device_count()} {device.platform}"
          " devices"
      ),
      "date": (
          datetime.datetime.now(datetime.timezone.utc).strftime(
              "%Y-%m-%d %H:%M UTC"
          )
      ),
      "commit": commit(),
      "command": shlex.join(
          ["python", "-m", "benchmarks", *map(portable_arg, argv)]
      ),
  }


def portable_arg(arg: str) -> str:
  """``arg`` with a path made readable anywhere: relative to the
  repository where it lies inside it, else ``.../`` and its last two parts
  (where this machine keeps its data says nothing to a reader). A relative
  path counts when it climbs out of the working directory (``../``)."""
  flag, eq, value = (
      arg.partition("=") if arg.startswith("--") else ("", "", arg)
  )
  path = pathlib.Path(value)
  if value.startswith("../"):
    path = (pathlib.Path.cwd() / path).resolve()
  if not path.is_absolute():
    return arg
  root = RESULTS_DIR.parents[1]
  if path.is_relative_to(root):
    short = str(path.relative_to(root))
  else:
    short = ".../" + "/".join(path.parts[1:][-2:])
  return f"{flag}{eq}{short}"


def write(
    name: str, records: list[dict[str, Any]], results_dir: os.PathLike
) -> pathlib.Path:
  """Writes ``records`` to ``results_dir/name.json``, atomically."""
  records = [
      {k: v.item() if hasattr(v, "item") else v for k, v in r.items()}
      for r in records
  ]
  for record in records:
    for key, value in record.items():
      if isinstance(value, (dict, list, tuple)):
        raise TypeError(f"record field {key!r} is not flat: {value!r}")
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"record field {key!r} is {value}: {record}")
  path = pathlib.Path(results_dir) / f"{name}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(records, indent=1) + "\n")
  tmp.replace(path)
  return path


def read(name: str, results_dir: os.PathLike) -> list[dict[str, Any]]:
  """The records of ``results_dir/name.json``; [] if there is none."""
  path = pathlib.Path(results_dir) / f"{name}.json"
  if not path.exists():
    return []
  return json.loads(path.read_text())


def _cell(value: Any) -> str:
  if value is None:
    return ""
  if isinstance(value, bool):
    return "yes" if value else "NO"
  if isinstance(value, int) or (
      isinstance(value, float) and value.is_integer() and abs(value) >= 1e3
  ):
    return f"{int(value):,}"
  if isinstance(value, float):
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
  return str(value)


def table(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
  """A Markdown table of ``rows``; ``columns`` maps field to header."""
  cells = [[_cell(row.get(key)) for key in columns] for row in rows]
  header = list(columns.values())
  widths = [
      max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
      for i, h in enumerate(header)
  ]
  line = (
      lambda xs: "| "
      + " | ".join(x.ljust(w) for x, w in zip(xs, widths))
      + " |"
  )
  return "\n".join(
      [line(header), line(["-" * w for w in widths])] + [line(c) for c in cells]
  )


def repeated(key: str, values: list[float]) -> dict[str, Any]:
  """Flat record fields of a figure measured once per run: ``key`` the
  median, ``key_min`` and ``key_max`` the spread, ``key_run1``... each
  run's, in the order they ran."""
  return {
      key: statistics.median(values),
      f"{key}_min": min(values),
      f"{key}_max": max(values),
      **{f"{key}_run{i}": v for i, v in enumerate(values, 1)},
  }


def runs(record: dict[str, Any], key: str) -> list[float]:
  """Each run's ``key`` of a record made by ``repeated``; [] if none."""
  values, i = [], 1
  while f"{key}_run{i}" in record:
    values.append(record[f"{key}_run{i}"])
    i += 1
  return values


def by_run(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
  """``rows`` grouped by the run that made them (its date and command), in
  the order the runs first appear."""
  runs: dict[tuple, list] = {}
  for r in rows:
    runs.setdefault((r["date"], r["command"]), []).append(r)
  return list(runs.values())
