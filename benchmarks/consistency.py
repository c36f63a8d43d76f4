"""What makes the report's records one report: the cluster's figures from
one run, the projection's update times those of the overhead records beside
it; and which machines its sections ran on.

``check`` returns a sentence per rule broken; ``report.write`` refuses to
write a report while any is. ``machines`` names the sections of each
machine, which the report prints where there is more than one.
"""

import re
from typing import Any

Records = dict[str, list[dict[str, Any]]]
# Records of another machine by design (a GPU run), not named by
# ``machines``.
OTHER_MACHINES = ("gpu",)
# Record files that must come from a single run each, and together: a
# ratio of the cluster's tables divides figures of the same run.
ONE_RUN = ("cluster", "cluster_links")
# The largest relative difference between the projection's update time and
# the overhead record's, for float round-trips through JSON.
_TOLERANCE = 1e-9


def machine(record: dict[str, Any]) -> str:
  """The processor and core count of a record's machine, without the JAX
  devices it simulated (a run's device count is its own choice)."""
  return re.sub(r", \d+ \w+ devices$", "", record["machine"])


def machines(found: Records) -> dict[str, list[str]]:
  """The record files of each machine that made them, in order."""
  out = {}
  for name, rows in found.items():
    if name in OTHER_MACHINES:
      continue
    for m in dict.fromkeys(map(machine, rows)):
      out.setdefault(m, []).append(name)
  return out


def _one_run(found: Records) -> list[str]:
  runs = {
      (r["date"], r["command"]) for name in ONE_RUN for r in found.get(name, ())
  }
  if len(runs) < 2:
    return []
  return [
      f"{' and '.join(f'{n}.json' for n in ONE_RUN)} mix {len(runs)} runs ("
      + "; ".join(sorted(date for date, _ in runs))
      + "): their ratios would divide figures of different runs. Rerun"
      " `python -m benchmarks cluster` with every method and link at once."
  ]


def _fresh_projection(found: Records) -> list[str]:
  known = {
      (r["model"], r["compressor"]): r["update_ms"] / 1e3
      for r in found.get("overhead", ())
      if not r.get("quick")
  }
  stale = sorted({
      f"{r['model']} {r['compressor']}"
      for r in found.get("projection", ())
      if r.get("kind") == "projection"
      and r.get("update_source") == "overhead.json"
      and abs(r["update_s"] - known.get((r["model"], r["compressor"]), -1))
      > _TOLERANCE * r["update_s"]
  })
  if not stale:
    return []
  return [
      "projection.json's update times are not those of overhead.json ("
      + ", ".join(stale)
      + "): rerun `python -m benchmarks project`, which reads them."
  ]


def check(found: Records) -> list[str]:
  """A sentence per rule that ``found`` (records by file name) breaks."""
  return _one_run(found) + _fresh_projection(found)
