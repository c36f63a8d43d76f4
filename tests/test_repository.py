"""The repository stands alone: no file names a folder outside it.

A default or a test that reads ``../something`` or an absolute folder of one
machine works only where that folder happens to exist, and fails on a
user's fresh clone.
"""

import pathlib
import re
import subprocess

THIS_FILE = pathlib.Path(__file__).resolve()
ROOT = THIS_FILE.parents[1]
# Folders that exist on one machine only.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root|mnt|scratch)/")
# /tmp/... is one machine's only where a file relies on it; an example
# command may pick a --workdir there.
TMP_PATH = re.compile(r"(?<!--workdir )(?<!--workdir=)(?<![\w.~-])/tmp/")
PARENT_PATH = re.compile(r"(?<![\w./])(?:\.\./)+[\w.-]+")


def tracked_files() -> list[pathlib.Path]:
  """The repository's files: git's list, or the tree where git has none."""
  try:
    names = subprocess.run(
        ["git", "ls-files", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", "__pycache__"}
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    ]
  return [ROOT / n for n in names if n and (ROOT / n).is_file()]


def outside_paths(path: pathlib.Path, text: str) -> list[str]:
  """Paths in ``text`` that lead out of the repository."""
  found = MACHINE_PATH.findall(text) + TMP_PATH.findall(text)
  # Documents link relative to their own folder; code opens paths relative
  # to the working directory, the repository's root.
  base = path.parent if path.suffix in (".md", ".rst") else ROOT
  for match in PARENT_PATH.finditer(text):
    target = (base / match.group()).resolve()
    if not target.is_relative_to(ROOT):
      found.append(match.group())
  return found


def test_no_file_names_a_folder_outside_the_repository():
  offenders = {}
  for path in tracked_files():
    relative = path.relative_to(ROOT).as_posix()
    # This file names such paths as the cases its check must catch.
    if path == THIS_FILE:
      continue
    try:
      text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # images
      continue
    lines = [
        f"{number}: {line.strip()[:100]}"
        for number, line in enumerate(text.splitlines(), start=1)
        if outside_paths(path, line)
    ]
    if lines:
      offenders[relative] = lines
  assert not offenders, offenders


def test_the_check_sees_each_kind_of_outside_path():
  code = ROOT / "train" / "data.py"
  assert outside_paths(code, 'path = "../shared/data/x.txt"')
  assert outside_paths(code, 'MNIST = "/work/shared/data/mnist"')
  assert outside_paths(code, 'default="/tmp/runs"')
  assert outside_paths(ROOT / "docs" / "a.md", "[x](../../outside.md)")
  assert not outside_paths(ROOT / "docs" / "a.md", "[x](../README.md)")
  assert not outside_paths(code, "python -m train --workdir /tmp/digits")


def test_a_records_command_names_no_folder_of_this_machine():
  from benchmarks import records

  argv = [
      "--results_dir=/tmp/perf/run",
      "convergence",
      "--char_lm_path",
      "/work/shared/data/tinyshakespeare/input.txt",
      f"--out={ROOT / 'benchmarks' / 'results'}",
  ]
  command = records.provenance(argv)["command"]
  assert not outside_paths(ROOT / "x.json", command), command
  assert ".../tinyshakespeare/input.txt" in command
  assert "--out=benchmarks/results" in command
