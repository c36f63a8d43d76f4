"""Faults around a run rather than inside a checkpoint: the workdir's files,
two runs on one workdir, processes that disagree, a state gone non-finite."""

import os
import re

import pytest

from tests.test_train import small_config
from train import metrics as metrics_lib
from train import tokenizer as tokenizer_lib
from train import train


def test_a_metrics_symlink_out_of_the_workdir_is_refused(tmp_path):
  outside = tmp_path / "elsewhere.jsonl"
  lines = b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
  outside.write_bytes(lines)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").symlink_to(outside)
  with pytest.raises(ValueError, match=f"symlink to {outside}, outside"):
    train.train_and_evaluate(small_config(steps=2), str(workdir))
  assert outside.read_bytes() == lines


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"loss": 1.0}\n', 'is not a metrics record (a JSON object with an int "step")'),
        (b'[2, 1.0]\n', "is not a metrics record"),
        (b'{"step": 2, "loss": "\xff"}\n', "is not UTF-8"),
    ],
)
def test_an_unreadable_metrics_line_is_named(line, message, tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1}\n' + line + b'{"step": 3}\n')
  with pytest.raises(ValueError, match=re.escape(f"{path}, line 2 {message}")):
    metrics_lib.MetricsLog(str(tmp_path), 1)


def test_a_damaged_tokenizer_file_is_named(tmp_path):
  path = str(tmp_path / "tokenizer.json")
  tokenizer_lib.train(["to be or not to be"] * 10, vocab_size=32).save(path)
  with open(path, "rb") as f:
    text = f.read()
  with open(path, "wb") as f:
    f.write(text[: len(text) // 2])
  with pytest.raises(ValueError, match=f"the tokenizer {path} cannot be read"):
    tokenizer_lib.load(path)
