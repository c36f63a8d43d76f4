"""The repository's shape: it stands alone, and its packages import in layers.

A default or a test that reads ``../something`` or an absolute folder of one
machine works only where that folder happens to exist, and fails on a
user's fresh clone. A loop of imports within a package works only for as
long as no module in it reads another's names at import time.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

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
    skip = {".git", ".venv", ".venv-floor", "__pycache__"}
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


def module_names(package: str) -> dict[str, pathlib.Path]:
  """Each module of ``package`` (a folder at the root) and of its
  subpackages, by dotted name (a package by its ``__init__.py``)."""
  modules = {}
  for path in sorted((ROOT / package).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def imported_modules(
    node: ast.AST, name: str, is_package: bool, modules: set[str]
) -> set[str]:
  """The modules of ``modules`` that an import statement ``node`` of module
  ``name`` reads; a package's ``__init__`` counts only where a name is taken
  from it, and the root package's not at all (every module imports it)."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names if "." in a.name} & modules
  if not isinstance(node, ast.ImportFrom):
    return set()
  if node.level:  # relative: from the package the module is in
    base = name.split(".")[: len(name.split(".")) - node.level + is_package]
    source = ".".join(base + ([node.module] if node.module else []))
  else:
    source = node.module
  found = set()
  for alias in node.names:
    if f"{source}.{alias.name}" in modules:
      found.add(f"{source}.{alias.name}")
    elif source in modules and "." in source:
      found.add(source)
  return found


def package_imports(*packages: str) -> dict[str, set[str]]:
  """Each module of ``packages`` (folders at the root) and of their
  subpackages, by dotted name, and the modules of those packages it imports,
  anywhere in its body."""
  modules = {}
  for package in packages:
    modules.update(module_names(package))
  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
      found |= imported_modules(node, name, is_package, set(modules))
    graph[name] = found - {name}
  return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One loop of imports in ``graph``, as the modules along it; [] if none."""
  done, path = set(), []

  def visit(name: str) -> list[str]:
    if name in path:
      return path[path.index(name) :] + [name]
    if name in done:
      return []
    path.append(name)
    for other in sorted(graph[name]):
      if loop := visit(other):
        return loop
    path.pop()
    done.add(name)
    return []

  for name in sorted(graph):
    if loop := visit(name):
      return loop
  return []


# The library and its tools, the two packages the wheel holds.
LIBRARY = ("acp_jax", "acp_jax_tools")
PACKAGES = (*LIBRARY, "train", "benchmarks")


def test_the_repository_has_no_import_loop():
  """Lazy imports inside functions count: a loop through one is a loop, and
  so is one through two packages."""
  loop = import_cycle(package_imports(*PACKAGES))
  assert not loop, " -> ".join(loop)


def test_the_loop_check_sees_a_loop():
  assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
      "a",
      "b",
      "c",
      "a",
  ]
  assert not import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}})


def test_the_loop_check_reads_subpackages():
  graph = package_imports(*LIBRARY)
  assert "acp_jax_tools.advice" in graph
  assert {"acp_jax_tools.costmodel", "acp_jax.registry"} <= graph[
      "acp_jax_tools.advice"
  ]
  assert "acp_jax_tools._hlo_text" in graph["acp_jax_tools.hlo"]
  modules = {"p.a", "p.sub", "p.sub.b", "p.sub.c"}
  for code in ("from . import c", "from .c import x", "import p.sub.c"):
    (node,) = ast.parse(code).body
    assert imported_modules(node, "p.sub.b", False, modules) == {"p.sub.c"}
  (node,) = ast.parse("from .sub import c").body
  assert imported_modules(node, "p", True, modules) == {"p.sub.c"}
  # A name taken from a subpackage's __init__ reads it; one from the root's
  # does not count.
  for code, read in (
      ("from p.sub import y", {"p.sub"}),
      ("from p import z", set()),
      ("import p", set()),
  ):
    (node,) = ast.parse(code).body
    assert imported_modules(node, "p.a", False, modules | {"p"}) == read


def test_no_module_of_the_library_imports_the_tools():
  """The measurement tools sit above the library: a training script that
  imports ``acp_jax`` loads none of them."""
  reads = {
      name: sorted(m for m in imported if m.startswith("acp_jax_tools"))
      for name, imported in package_imports(*LIBRARY).items()
      if name.split(".")[0] == "acp_jax"
  }
  assert not {name: tools for name, tools in reads.items() if tools}


def test_importing_the_library_loads_no_tool():
  code = (
      "import sys\n"
      "import acp_jax\n"
      "loaded = [m for m in sys.modules if m.startswith('acp_jax_tools')]\n"
      "assert not loaded, loaded\n"
      "assert acp_jax.advise.__module__ == 'acp_jax_tools.advice'\n"
      "assert acp_jax.Advice is acp_jax.advice.Advice\n"
      "assert acp_jax.hlo is sys.modules['acp_jax_tools.hlo']\n"
      "assert 'acp_jax_tools.advice' in sys.modules\n"
      "try:\n"
      "  acp_jax.no_such_name\n"
      "except AttributeError as e:\n"
      "  assert \"'acp_jax'\" in str(e) and 'no_such_name' in str(e), e\n"
      "else:\n"
      "  raise AssertionError('no AttributeError')\n"
  )
  result = subprocess.run(
      [sys.executable, "-c", code],
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]


# Reading the Python stack or JAX's tracer internals, or a metaclass (whose
# comparison hooks run only where JAX's error path compares node types):
# checks built on them stop checking, silently, when optax or JAX renames a
# frame, a local variable or an attribute, or reorders an error path.
INSPECTION = re.compile(
    r"\binspect\.stack\b|\bcurrentframe\b|\bsys\._getframe\b|\bf_locals\b"
    r"|\bf_back\b|\.parent\b|[\"']parent[\"']|\bin_tracers\b|\._trace\b"
    r"|\bmetaclass="
)


def inspections(text: str) -> list[str]:
  return [m.group() for m in INSPECTION.finditer(text)]


def test_the_library_reads_no_stack_and_no_tracer_internals():
  found = {
      str(path.relative_to(ROOT)): inspections(path.read_text())
      for package in LIBRARY
      for path in sorted((ROOT / package).rglob("*.py"))
  }
  assert not {name: hits for name, hits in found.items() if hits}


# A private module of a library (``jax._src``, ``optax._src``, a logger of
# one): renamed or moved in any release, without notice.
PRIVATE_MODULE = re.compile(r"\b(?:jax|jaxlib|optax|flax|chex|orbax)[\w.]*\._src\b")


def test_no_code_reads_a_private_module_of_its_libraries():
  found = {
      str(path.relative_to(ROOT)): PRIVATE_MODULE.findall(path.read_text())
      for package in (*PACKAGES, "tests", "configs")
      for path in sorted((ROOT / package).rglob("*.py"))
      if path != THIS_FILE
  }
  assert not {name: hits for name, hits in found.items() if hits}
  for code in (
      "from optax._src import numerics",
      "logging.getLogger('jax._src.debugging')",
      "import orbax.checkpoint._src.path",
  ):
    assert PRIVATE_MODULE.search(code), code
  assert not PRIVATE_MODULE.search("optax.safe_increment(count)")


def test_the_inspection_check_sees_each_kind():
  for code in (
      "inspect.stack()",
      "frame = sys._getframe(1)",
      "inspect.currentframe()",
      "frame = frame.f_back",
      "local = frame.f_locals",
      "parent = x.parent",
      'parent = getattr(x, "parent", None)',
      "for t in parent.in_tracers:",
      "class LocalGrads(metaclass=_LocalGradsType):",
  ):
    assert inspections(code), code
  assert not inspections("root = path.parents[1]; tx.parent_state")


def _ci_list(name: str) -> list[str]:
  """The words of the bash array ``name=(...)`` in ``.ci/run``."""
  text = (ROOT / ".ci" / "run").read_text()
  match = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
  assert match, f".ci/run has no {name}=(...)"
  return match.group(1).split()


def test_ci_tests_the_floors_the_package_declares():
  """The floors in pyproject.toml are the versions CI's floor venv pins,
  and its core tests need neither flax nor the trainer."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  declared = project["dependencies"] + project["optional-dependencies"][
      "checkpoint"
  ]
  floors = dict(
      re.fullmatch(r"([\w-]+)>=([\w.]+)", d.split(";")[0].strip()).groups()
      for d in declared
  )
  pinned = dict(p.split("==") for p in _ci_list("FLOORS"))
  for package in ("jax", "optax", "orbax-checkpoint"):
    assert pinned[package] == floors[package], package
  assert pinned["jaxlib"] == pinned["jax"]
  newer = re.compile(r"^(from|import) (flax|train|benchmarks)\b", re.M)
  for path in _ci_list("CORE_TESTS"):
    assert not newer.search((ROOT / path).read_text()), path


# The most lines of a library module.
MODULE_LINES = 600
# The most lines of code of a library function (docstring, comments and
# blank lines aside), nested functions included.
FUNCTION_LINES = 60


def _code_lines(node: ast.AST, lines: list[str]) -> int:
  body = node.body
  docstring = set()
  if (
      body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
  ):
    docstring = set(range(body[0].lineno, body[0].end_lineno + 1))
  return sum(
      1
      for number in range(node.lineno, node.end_lineno + 1)
      if number not in docstring
      and lines[number - 1].strip()
      and not lines[number - 1].strip().startswith("#")
  )


def test_library_modules_and_functions_stay_short():
  too_long = []
  paths = [p for package in LIBRARY for p in (ROOT / package).rglob("*.py")]
  for path in sorted(paths):
    text = path.read_text()
    lines = text.splitlines()
    if len(lines) > MODULE_LINES:
      too_long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (n := _code_lines(node, lines)) > FUNCTION_LINES:
          too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {n} lines")
  assert not too_long, too_long
