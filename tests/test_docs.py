"""The README and the docs as tested documents, and the examples they show."""

import ast
import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

import acp_jax
from acp_jax import checkpoint
from acp_jax import phase
from acp_jax_tools import hlo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
# Fences that would read as Python to a reader but escape the run below.
_UNRUN_PYTHON = re.compile(
    r"^(py|python3|ipython|pycon|\{code-block\}\s*python)\b"
)


def pages():
  """README.md and every page of the docs, relative to the repository."""
  found = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
  found = [p for p in found if os.sep + "_build" + os.sep not in p]
  return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in found)


def fences(page):
  with open(os.path.join(ROOT, page)) as f:
    return _FENCE.findall(f.read())


def python_blocks(page):
  return [body for info, body in fences(page) if info.strip() == "python"]


PAGES_WITH_CODE = [page for page in pages() if python_blocks(page)]


def run_python(args, timeout=600):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "8"}
  result = subprocess.run(
      [sys.executable, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_the_guides_have_code_and_every_python_block_is_run():
  assert "docs/guides/getting_started.md" in PAGES_WITH_CODE
  assert len(PAGES_WITH_CODE) >= 6, PAGES_WITH_CODE
  assert SLOW_PAGES <= set(PAGES_WITH_CODE), SLOW_PAGES
  for page in pages():
    for info, _ in fences(page):
      assert not _UNRUN_PYTHON.match(info.strip()), (
          f"{page}: a ```{info} block would not run in the tests; fence"
          " Python as ```python"
      )


# Pages whose blocks train or compile for long run in the slow tier.
SLOW_PAGES = {
    "docs/guides/trainer.md",
    "docs/guides/optax_orbax.md",
    "docs/guides/lowrank.md",
}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PAGES else [])
        for p in PAGES_WITH_CODE
    ],
)
def test_python_blocks_run_in_order(page, tmp_path):
  script = tmp_path / "page.py"
  script.write_text("\n\n".join(python_blocks(page)))
  run_python([str(script)])


def _documented():
  """Names the API page documents, by their module."""
  with open(os.path.join(DOCS, "api.md")) as f:
    text = f.read()
  names, module = set(), None
  for line in text.splitlines():
    if m := re.match(r"\.\. (?:currentmodule|automodule):: (\S+)", line):
      module = m.group(1)
    elif m := re.match(r"\.\. auto(?:function|class|exception):: (\S+)", line):
      names.add(f"{module}.{m.group(1)}")
  return names


def _public(module):
  return {
      f"{module.__name__}.{name}"
      for name, value in vars(module).items()
      if not name.startswith("_")
      and (inspect.isfunction(value) or inspect.isclass(value))
      and value.__module__ == module.__name__
  }


def test_api_page_documents_every_public_name():
  wanted = {f"acp_jax.{name}" for name in acp_jax.__all__}
  wanted |= _public(checkpoint) | _public(hlo) | _public(phase)
  # Phase is documented where users import it from.
  wanted -= {f"acp_jax.phase.{name}" for name in acp_jax.__all__}
  assert wanted - _documented() == set()


def test_the_guide_gives_the_phase_markers_shapes_of_the_code():
  shapes = {p: phase.marker(p).shape for p in phase.Phase}
  stated = (
      f"zeros of shape {shapes[phase.Phase.P]} before a P-step,"
      f" {shapes[phase.Phase.Q]} before a Q-step,"
      f" {shapes[phase.Phase.DENSE]} during the warm-up"
  )
  with open(os.path.join(DOCS, "guides", "how_acp_sgd_works.md")) as f:
    assert stated in " ".join(f.read().split())
  assert ", ".join(map(str, shapes.values())) in " ".join(phase.__doc__.split())


def test_mistakes_page_cites_tests_that_exist():
  with open(os.path.join(DOCS, "guides", "mistakes.md")) as f:
    cited = re.findall(r"`(tests/test_\w+\.py)::(\w+)`", f.read())
  assert len(cited) >= 20
  for path, name in cited:
    with open(os.path.join(ROOT, path)) as f:
      tree = ast.parse(f.read())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert name in defined, f"{path}::{name} is cited but not defined"


@pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None
        for m in ("sphinx", "myst_parser", "sphinx_book_theme")
    ),
    reason='the docs need the [docs] extra: pip install -e ".[docs]"',
)
def test_docs_build_with_warnings_as_errors(tmp_path):
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "sphinx",
          "-W",
          "--keep-going",
          "-q",
          "-b",
          "html",
          "-d",
          str(tmp_path / "doctrees"),
          "docs",
          str(tmp_path / "html"),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert os.path.exists(tmp_path / "html" / "api.html")


@pytest.mark.parametrize(
    "page", ["README.md", "docs/guides/getting_started.md"]
)
def test_nnx_diff_is_the_diff_of_the_examples(page):
  (diff,) = [body for info, body in fences(page) if info.strip() == "diff"]
  examples = {}
  for name in ("nnx_plain", "nnx_compressed"):
    with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
      examples[name] = f.read().splitlines()
  for line in diff.splitlines():
    mark, code = line[:1], line[1:]
    if code.strip() in ("", "..."):
      continue
    wanted = {"-": ["nnx_plain"], "+": ["nnx_compressed"]}.get(
        mark, ["nnx_plain", "nnx_compressed"]
    )
    for name in wanted:
      assert code in examples[name], f"{page}: {line!r} is not in {name}.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnx_plain", "nnx_compressed"])
def test_examples_train(name):
  out = run_python([os.path.join("examples", f"{name}.py"), "40"])
  loss = float(re.search(r"loss (\S+),", out).group(1))
  assert loss < 1.5, out  # chance is ln 10 = 2.3
