"""``python -m benchmarks ... --quick``, end to end, and the JSON it writes.

Each subcommand runs once, as a user would run it, in a process of its own;
the tests read what it wrote. The convergence run reads small data files
written here in the MNIST IDX and plain-text formats, so it needs no data
set.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import overhead
from benchmarks import records
from tests import datafiles

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPRESSORS = ("ssgd", "sign_sgd", "topk_sgd", "power_sgd", "acp_sgd")
PROVENANCE = ("machine", "date", "command", "quick")


def _run(*args, timeout=600):
  return subprocess.run(
      [sys.executable, "-m", "benchmarks", *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A 400-image MNIST look-alike and a 30,000-character text."""
  root = tmp_path_factory.mktemp("data")
  datafiles.write_mnist(root / "mnist", 400)
  rng = np.random.default_rng(0)
  text = root / "text.txt"
  words = ["to", "be", "or", "not", "that", "is", "the", "question"]
  text.write_text(" ".join(rng.choice(words, 7000)))
  return root


@pytest.fixture(scope="module")
def results(tmp_path_factory, data_dir):
  """Every subcommand's --quick run, into one results folder."""
  out = tmp_path_factory.mktemp("results")
  runs = {
      "comm": ["comm", "--quick"],
      "overhead": ["overhead", "--quick"],
      "convergence": [
          "convergence",
          "--quick",
          f"--mnist_path={data_dir / 'mnist'}",
          f"--char_lm_path={data_dir / 'text.txt'}",
      ],
      # The link latency is given: no cluster ran here to calibrate it.
      "project": [
          "project",
          "--quick",
          "--models=small_cnn",
          "--alpha_us=500",
      ],
      "report": ["report"],
  }
  for name, args in runs.items():
    result = _run(f"--results_dir={out}", *args)
    assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr}"
  return out


def _records(results, name):
  rows = records.read(name, results)
  assert rows, name
  for row in rows:
    for key in PROVENANCE:
      assert key in row, (name, key)
    assert row["quick"] is True
    for key, value in row.items():
      assert not isinstance(value, (dict, list)), (name, key)
      if isinstance(value, float):
        assert math.isfinite(value), (name, key, value)
  return rows


def test_comm_hlo_equals_accounting(results):
  rows = _records(results, "comm")
  models = {r["model"] for r in rows}
  assert models == {"small_cnn", "char_lm", "resnet18_cifar"}
  for model in models:
    by_name = {r["compressor"]: r for r in rows if r["model"] == model}
    assert set(by_name) == set(COMPRESSORS)
    for row in by_name.values():
      assert row["hlo_bytes_per_step"] == row["bytes_per_step"] > 0
      assert row["hlo_matches_accounting"] is True
    acp, power = by_name["acp_sgd"], by_name["power_sgd"]
    assert acp["bytes_per_step"] == (acp["bytes_p"] + acp["bytes_q"]) / 2
    assert acp["meets_target"] is True
    assert (acp["rounds"], power["rounds"], by_name["ssgd"]["rounds"]) == (
        1,
        2,
        1,
    )
    assert by_name["ssgd"]["ratio_vs_ssgd"] == 1
    assert acp["ratio_vs_ssgd"] > power["ratio_vs_ssgd"] > 1


def test_comm_compiles_the_train_step_for_its_overlap(results):
  rows = _records(results, "overlap")
  assert {(r["model"], r["compressor"], r["phase"]) for r in rows} == {
      ("small_cnn", c, p)
      for c in COMPRESSORS
      for p in (("p", "q") if c == "acp_sgd" else ("step",))
  }
  for row in rows:
    # Its 115 KB of gradients fit one default bucket: the layouts agree.
    assert row["buckets_before"] == row["buckets_after"] == 1
    for layout in ("before", "after"):
      assert row[f"collectives_{layout}"] >= 2  # and the metrics' all-reduce
      assert 0 <= row[f"upstream_{layout}"] <= row[f"independent_{layout}"] < 1
    assert row["upstream_before"] == row["upstream_after"]
    assert row["compile_s"] > 0
  report = (results / "REPORT.md").read_text()
  assert "### Overlap with backprop" in report


def test_overhead_times_every_compressor(results):
  rows = _records(results, "overhead")
  for model in {r["model"] for r in rows}:
    by_name = {r["compressor"]: r for r in rows if r["model"] == model}
    # A plain psum per leaf and PyTorch's Power-SGD hook on two thread
    # settings are timed beside ours (torch is a test dependency).
    assert set(by_name) == set(COMPRESSORS) | {
        overhead.PSUM,
        overhead.TORCH,
        overhead.TORCH_ONE_THREAD,
    }
    for row in by_name.values():
      assert row["update_ms"] > 0 and row["repeats"] == 3
    acp, power = by_name["acp_sgd"], by_name["power_sgd"]
    assert acp["update_ms"] == pytest.approx(
        (acp["update_ms_p"] + acp["update_ms_q"]) / 2
    )
    assert acp["vs_power_sgd"] == pytest.approx(
        acp["update_ms"] / power["update_ms"]
    )
    # Ours are measured against PyTorch at its faster setting.
    torch_ms = min(
        by_name[n]["update_ms"]
        for n in (overhead.TORCH, overhead.TORCH_ONE_THREAD)
    )
    for row in (acp, power):
      assert row["vs_torch"] == pytest.approx(row["update_ms"] / torch_ms)
      assert by_name[row["torch_reference"]]["update_ms"] == torch_ms
    ssgd = by_name["ssgd"]
    assert ssgd["vs_psum"] == pytest.approx(
        ssgd["update_ms"] / by_name[overhead.PSUM]["update_ms"]
    )


def test_convergence_runs_every_variant_and_counts_warmup_bytes(results):
  from benchmarks import convergence
  from benchmarks import convergence_summary

  finals = _records(results, "convergence")
  curves = _records(results, "convergence_curves")
  tasks = ("mnist", "char_lm", "char_lm_sgd")
  assert {(r["task"], r["variant"]) for r in finals} == {
      (t, v) for t in tasks for v in convergence.QUICK_VARIANTS
  }
  assert {(r["task"], r["optimizer"]) for r in finals} == {
      ("mnist", "sgd"),
      ("char_lm", "adamw"),
      ("char_lm_sgd", "sgd"),
  }
  for row in finals:
    points = [
        c
        for c in curves
        if (c["task"], c["variant"], c["seed"])
        == (row["task"], row["variant"], row["seed"])
    ]
    assert [p["step"] for p in points] == sorted(p["step"] for p in points)
    assert points[-1]["step"] == row["steps"]
    assert points[-1]["eval_loss"] == pytest.approx(row["eval_loss"])
    assert points[-1]["bytes_sent"] == row["bytes_sent"]
    assert 0 <= row["eval_accuracy"] <= 1
    if not row["warmup_steps"]:
      assert row["bytes_sent"] == row["bytes_per_step"] * row["steps"]
  by = {(r["task"], r["variant"]): r for r in finals}
  for task in ("mnist", "char_lm"):
    cold, warm = by[task, "acp_sgd"], by[task, "acp_sgd_warm"]
    dense = by[task, "ssgd"]["bytes_per_step"]
    k = convergence.QUICK_WARMUP_STEPS
    # The warm-up's steps send S-SGD's bytes, the rest ACP-SGD's.
    assert warm["bytes_sent"] == pytest.approx(
        k * dense + (warm["steps"] - k) * cold["bytes_per_step"], rel=0.01
    )
  summary = convergence_summary.summarize(finals, curves)
  ssgd = next(r for r in summary if r["variant"] == "ssgd")
  assert ssgd["accuracy_vs_ssgd_pts"] == 0 and ssgd["seeds"] == 1
  assert ssgd["steps_to_target_ratio"] == 1.0


def test_report_has_targets_and_plots(results):
  report = (results / "REPORT.md").read_text()
  assert "## Targets" in report and "--quick" in report
  for section in ("Communication", "overhead", "Convergence"):
    assert section in report
  for plot in ("comm_bytes.png", "overhead.png", "convergence.png"):
    assert f"]({plot})" in report
    assert (results / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_projection_covers_the_paper_grid(results):
  rows = _records(results, "projection")
  assert {r["kind"] for r in rows} == {"projection"}  # no cluster ran
  grid = {
      (r["workers"], r["bandwidth"], r["compute_scale"], r["compressor"])
      for r in rows
  }
  assert len(grid) == len(rows) == 4 * 3 * 3 * 5
  for row in rows:
    assert row["predicted_examples_per_sec"] > 0
    assert row["alpha_s"] == pytest.approx(500e-6)
    if row["compressor"] == "acp_sgd":
      assert row["acp_speedup"] == pytest.approx(1.0)
  # ACP-SGD sends less than S-SGD: faster links can only shrink its lead.
  for p in (8, 64):
    lead = [
        next(
            r["acp_speedup"]
            for r in rows
            if (r["workers"], r["bandwidth"], r["compute_scale"])
            == (p, bandwidth, 100)
            and r["compressor"] == "ssgd"
        )
        for bandwidth in ("1gbit", "10gbit", "100gbit")
    ]
    assert lead == sorted(lead, reverse=True), lead
  report = (results / "REPORT.md").read_text()
  assert "Projection to the paper's clusters" in report
  assert (results / "projection.png").read_bytes()[:4] == b"\x89PNG"


def test_sign_sgd_scales_with_devices_like_ssgd(tmp_path):
  result = _run(
      f"--results_dir={tmp_path}", "sign_scaling", "--quick", timeout=300
  )
  assert result.returncode == 0, result.stderr
  rows = _records(tmp_path, "sign_scaling")
  assert {(r["num_devices"], r["compressor"]) for r in rows} == {
      (n, c) for n in (1, 2) for c in ("sign_sgd", "sign_sgd_vote", "ssgd")
  }
  assert all(r["status"] == "ok" for r in rows), rows
  seconds = {(r["num_devices"], r["compressor"]): r["update_s"] for r in rows}
  # A second device doubles the work on shared cores; a reduce left to
  # XLA:CPU's YNNPACK fusion made it hundreds of times slower.
  for name in ("sign_sgd", "sign_sgd_vote"):
    assert seconds[2, name] < 20 * seconds[1, name], seconds


def test_bad_device_counts_are_refused(tmp_path):
  for devices in ("1,two", "0,2"):
    result = _run(
        f"--results_dir={tmp_path}",
        "sign_scaling",
        f"--devices={devices}",
        timeout=120,
    )
    assert result.returncode != 0
    assert "--devices" in result.stderr and devices in result.stderr


def test_projection_without_a_latency_says_how_to_get_one(tmp_path):
  result = _run(f"--results_dir={tmp_path}", "project", "--quick", timeout=120)
  assert result.returncode != 0
  assert "benchmarks cluster" in result.stderr and "--alpha_us" in result.stderr


def test_missing_data_file_is_a_clear_error(tmp_path):
  result = _run(
      f"--results_dir={tmp_path}",
      "convergence",
      "--quick",
      "--tasks=mnist",
      f"--mnist_path={tmp_path / 'nowhere'}",
      timeout=120,
  )
  assert result.returncode != 0
  assert "--mnist_path" in result.stderr and "nowhere" in result.stderr
  assert not list(tmp_path.glob("*.json"))


def test_data_paths_are_asked_for_with_where_to_get_them(tmp_path):
  result = _run(
      f"--results_dir={tmp_path}", "convergence", "--quick", timeout=120
  )
  assert result.returncode != 0
  assert "char_lm_long task needs --char_lm_path" in result.stderr
  assert "tinyshakespeare/input.txt" in result.stderr
  assert not list(tmp_path.glob("*.json"))


def test_report_without_results_says_what_to_run(tmp_path):
  result = _run(f"--results_dir={tmp_path}", "report", timeout=120)
  assert result.returncode != 0
  assert "python -m benchmarks comm" in result.stderr


def test_unknown_model_is_refused(tmp_path):
  result = _run(
      f"--results_dir={tmp_path}", "comm", "--models=resnet51", timeout=120
  )
  assert result.returncode != 0
  assert "resnet51" in result.stderr and "resnet50" in result.stderr


def test_records_must_be_flat_and_finite(tmp_path):
  with pytest.raises(TypeError, match="'curve' is not flat"):
    records.write("x", [{"curve": [1, 2]}], tmp_path)
  with pytest.raises(ValueError, match="'loss' is nan"):
    records.write("x", [{"loss": float("nan")}], tmp_path)
  path = records.write(
      "x", [{"ok": np.float32(1.5), "n": np.int64(2)}], tmp_path
  )
  assert json.loads(path.read_text()) == [{"ok": 1.5, "n": 2}]
