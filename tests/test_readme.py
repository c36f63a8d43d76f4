"""The README as a tested document, and the examples it shows."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def run_python(args, timeout=600):
  env = {**os.environ, "PYTHONPATH": ROOT}
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


def test_readme_python_blocks_run_in_order(tmp_path):
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = _BLOCK.findall(f.read())
  assert len(blocks) >= 6
  script = tmp_path / "readme.py"
  script.write_text("\n\n".join(blocks))
  out = run_python([str(script)])
  assert "Phase.Q" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnx_plain", "nnx_compressed"])
def test_examples_train(name):
  out = run_python([os.path.join("examples", f"{name}.py"), "40"])
  loss = float(re.search(r"loss (\S+),", out).group(1))
  assert loss < 1.5, out  # chance is ln 10 = 2.3
