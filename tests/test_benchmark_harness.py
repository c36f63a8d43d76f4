"""``python -m benchmarks``'s parser and its report, without running a
benchmark: the flags each subcommand declares, and REPORT.md written from
the committed records."""

import json
import shutil

import pytest

import benchmarks
from benchmarks import __main__ as cli_main
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
