"""``python -m benchmarks``'s parser and its report, without running a
benchmark: the flags each subcommand declares, and REPORT.md written from
the committed records."""

import json
import os
import shutil

import pytest

import benchmarks
from benchmarks import __main__ as cli_main
from benchmarks import consistency
from benchmarks import records
from benchmarks import report


@pytest.fixture(scope="module")
def parser():
  return cli_main.parser()


def test_every_subcommand_is_registered(parser, capsys):
  for name in benchmarks.SUBCOMMANDS:
    with pytest.raises(SystemExit) as done:
      parser.parse_args([name, "--help"])
    assert done.value.code == 0
    assert f"python -m benchmarks {name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["sign_scaling", "--devices=1,two"], "--devices", "'1,two'"),
        (["sign_scaling", "--devices=0,2"], "--devices", "'0,2'"),
        (["cluster", "--workers=1,2"], "--workers", "'1,2'"),
        (["cluster", "--steps=3"], "--steps", "3"),
        (["cluster", "--bandwidths=1gbit,2gbit"], "--bandwidths", "'2gbit'"),
        (["cluster", "--compressors=acp"], "--compressors", "'acp'"),
        (["overhead", "--repeats=0"], "--repeats", "0"),
        (["comm", "--models=resnet51"], "--models", "'resnet51'"),
        (["comm", "--overlap_models=bert"], "--overlap_models", "'bert'"),
        (["convergence", "--tasks=mnist,cifar"], "--tasks", "'cifar'"),
    ],
)
def test_a_bad_flag_is_refused_while_parsing(parser, capsys, argv, flag, value):
  with pytest.raises(SystemExit) as done:
    parser.parse_args(argv)
  assert done.value.code == 2
  error = capsys.readouterr().err
  assert f"argument {flag}: " in error and value in error, error


def test_flags_parse_into_values(parser):
  args = parser.parse_args(
      ["cluster", "--workers=2,4", "--bandwidths=1gbit", "--steps=4"]
  )
  assert (args.workers, args.bandwidths, args.steps) == ([2, 4], ["1gbit"], 4)
  assert parser.parse_args(["comm", "--overlap_models="]).overlap_models == []
  assert parser.parse_args(["convergence"]).tasks == [
      "char_lm_long",
      "char_lm_sgd",
      "char_lm",
      "mnist",
      "mnist_long",
  ]
  assert parser.parse_args(
      ["convergence", "--variants=acp_sgd_warm,ssgd"]
  ).variants == ["acp_sgd_warm", "ssgd"]


@pytest.fixture
def committed(tmp_path):
  """A copy of the committed records, beside which a report can be
  written."""
  for path in records.RESULTS_DIR.glob("*.json"):
    shutil.copy(path, tmp_path)
  return tmp_path


def test_the_report_regenerates_from_the_committed_records(committed):
  report.write(committed)
  written = (committed / "REPORT.md").read_text()
  assert written == (records.RESULTS_DIR / "REPORT.md").read_text()


def test_machine_facts_come_from_the_records(committed):
  for path in committed.glob("*.json"):
    rows = json.loads(path.read_text())
    for row in rows:
      row["machine"] = row["machine"].replace("(2 cores)", "(16 cores)")
    path.write_text(json.dumps(rows))
  report.write(committed)
  written = (committed / "REPORT.md").read_text()
  assert "this machine's 16 cores (2 workers: 0.125 per core" in written
  assert "2 cores" not in written


def test_the_overlap_target_takes_each_models_lowest_phase():
  from benchmarks import targets

  def row(model, phase, upstream, compressor="acp_sgd"):
    return {
        "model": model,
        "compressor": compressor,
        "phase": phase,
        "upstream_after": upstream,
    }

  rows = [
      row("resnet50", "p", 0.70),
      row("resnet50", "q", 0.60),
      row("bert_base", "p", 0.30),
      row("bert_base", "q", 0.40),
      row("bert_base", "step", 0.01, compressor="power_sgd"),
  ]
  ((_, measured, met),) = targets.check({"overlap": rows})
  assert measured == "resnet50: 0.60, bert_base: 0.30"
  assert met is True
  rows[2] = row("bert_base", "p", 0.20)  # one phase below its goal
  assert targets.check({"overlap": rows})[0][2] is False
  # A model without records cannot meet its goal.
  assert targets.check({"overlap": rows[:2]})[0][2] is False


def _row(**fields):
  return {
      "machine": "Some CPU (2 cores), jax 0.10.2, 8 cpu devices",
      "date": "2026-12-03 04:00 UTC",
      "command": "python -m benchmarks cluster",
      **fields,
  }


def test_a_report_of_one_machine_and_one_cluster_run_is_consistent():
  found = {
      "comm": [_row()],
      # Another device count is the same machine.
      "cluster": [
          _row(machine="Some CPU (2 cores), jax 0.10.2, 1 cpu devices")
      ],
      "cluster_links": [_row()],
      "gpu": [_row(machine="A GPU host (16 cores), jax 0.10.2, 1 gpu devices")],
  }
  assert consistency.check(found) == []


def test_the_machines_of_the_sections_are_named():
  other = _row(machine="Other CPU (2 cores), jax 0.10.2, 1 cpu devices")
  found = {"comm": [_row()], "projection": [other]}
  assert consistency.check(found) == []
  assert consistency.machines(found) == {
      "Some CPU (2 cores), jax 0.10.2": ["comm"],
      "Other CPU (2 cores), jax 0.10.2": ["projection"],
  }


def test_cluster_ratios_of_several_runs_are_refused():
  found = {
      "cluster": [_row(), _row(date="2026-12-01 00:12 UTC")],
      "cluster_links": [_row()],
  }
  (broken,) = consistency.check(found)
  assert "mix 2 runs" in broken and "python -m benchmarks cluster" in broken
  # The links' calibration belongs to the run of the ratios too.
  found = {"cluster": [_row()], "cluster_links": [_row(command="other")]}
  assert consistency.check(found)


def test_a_projection_of_other_update_times_is_stale():
  overhead = [_row(model="resnet50", compressor="acp_sgd", update_ms=44.0)]
  projected = _row(
      kind="projection",
      model="resnet50",
      compressor="acp_sgd",
      update_s=0.044,
      update_source="overhead.json",
  )
  found = {"overhead": overhead, "projection": [projected]}
  assert consistency.check(found) == []
  found["projection"] = [{**projected, "update_s": 0.093}]
  (broken,) = consistency.check(found)
  assert "resnet50 acp_sgd" in broken and "benchmarks project" in broken


def test_the_report_refuses_records_that_do_not_make_one(committed):
  path = committed / "cluster.json"
  rows = json.loads(path.read_text())
  rows[0]["date"] = "1999-01-01 00:00 UTC"
  path.write_text(json.dumps(rows))
  with pytest.raises(SystemExit, match="do not make one report"):
    report.write(committed)


def test_the_readme_table_is_the_committed_cluster_run():
  from benchmarks import report_cluster

  rows = records.read("cluster", records.RESULTS_DIR)
  readme = (records.RESULTS_DIR.parents[1] / "README.md").read_text()
  assert report_cluster.summary_table(rows) in readme


def test_the_readme_headline_is_the_committed_time_to_quality_runs():
  from benchmarks import report_quality

  rows = report_quality.with_startup(
      records.read("quality", records.RESULTS_DIR),
      records.read("quality_curves", records.RESULTS_DIR),
  )
  readme = (records.RESULTS_DIR.parents[1] / "README.md").read_text()
  runs = records.by_run(rows)
  assert runs
  for run in runs:
    assert report_quality.summary_table(run) in readme
  assert report_quality.overview_table(rows) in readme


def test_a_record_names_the_commit_it_was_measured_on(monkeypatch, tmp_path):
  import subprocess

  head = subprocess.run(
      ["git", "rev-parse", "--short=12", "HEAD"],
      cwd=records.RESULTS_DIR.parents[1],
      capture_output=True,
      text=True,
      check=False,
  )
  if head.returncode != 0:
    pytest.skip("not a git checkout")
  commit = records.provenance(["comm"])["commit"]
  assert commit in (head.stdout.strip(), head.stdout.strip() + "+changes")
  # Outside a checkout it says so rather than naming another commit.
  monkeypatch.setattr(records, "RESULTS_DIR", tmp_path / "a" / "results")
  assert records.commit() == "unknown"


def test_a_path_climbing_out_of_the_working_directory_is_shortened(
    monkeypatch, tmp_path
):
  """A relative data path that climbs out of the working directory named a
  folder outside the repository in the records' commands."""
  (tmp_path / "work").mkdir()
  monkeypatch.chdir(tmp_path / "work")
  climbing = os.path.join(os.pardir, "data", "input.txt")
  assert records.portable_arg(f"--char_lm_path={climbing}") == (
      "--char_lm_path=.../data/input.txt"
  )
  assert records.portable_arg("--steps=500") == "--steps=500"
