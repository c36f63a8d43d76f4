"""The report's prose: the snippets of ``report_template.md``, filled.

A snippet starts at a line ``<!-- name -->`` and runs to the next one; its
fields are ``str.format`` fields. A paragraph of it (lines between blank
lines) is joined into one line, except a fenced code block, so that the
template reads in short lines and the report has one line a paragraph.
"""

import functools
import pathlib
import re
from collections.abc import Iterable
from typing import Any

TEMPLATE = pathlib.Path(__file__).with_name("report_template.md")


def snippets(text: str) -> dict[str, str]:
  """The snippets of a template's ``text`` by name, paragraphs joined; what
  comes before the first one is the template's own comment."""
  parts = re.split(r"^<!-- (\w+) -->\n", text, flags=re.MULTILINE)
  return {
      name: "\n\n".join(
          p if p.startswith("```") else " ".join(p.splitlines())
          for p in body.strip().split("\n\n")
      )
      for name, body in zip(parts[1::2], parts[2::2])
  }


@functools.cache
def _snippets() -> dict[str, str]:
  return snippets(TEMPLATE.read_text())


def fill(name: str, **fields: Any) -> str:
  """Snippet ``name`` of ``report_template.md`` with ``fields`` filled in."""
  return _snippets()[name].format(**fields)


def provenance(rows: list[dict[str, Any]]) -> str:
  """A line per run that made ``rows``: its machine, date, commit (records
  older than that field say it was not recorded) and command."""
  runs = sorted({
      (r["machine"], r["date"], r.get("commit", "not recorded"), r["command"])
      for r in rows
  })
  return "\n".join(
      fill(
          "provenance", machine=machine, date=date, commit=commit,
          command=command,
      )
      for machine, date, commit, command in runs
  )


def and_list(items: Iterable[str]) -> str:
  """``a``, ``a and b``, ``a, b and c``."""
  items = list(items)
  if len(items) < 2:
    return "".join(items)
  return ", ".join(items[:-1]) + " and " + items[-1]
