"""Masked LM on a text file: the WordPiece tokenizer, BERT's masking, and a
small BERT whose held-out loss falls, on a play-like text written here."""

import json
import os

import numpy as np
import pytest

from configs import bert_shakespeare
from train import data
from train import experiment as experiment_lib
from train import tokenizer
from train import train
from tests import datafiles

SEQ_LEN = 32
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "play.txt"
  datafiles.write_text(path, 6000)
  return str(path)


def build(text_path, tmp_path, **overrides):
  config = dict(
      name="masked_text",
      path=text_path,
      seq_len=SEQ_LEN,
      vocab_size=VOCAB_SIZE,
      tokenizer=str(tmp_path / "wordpiece.json"),
  )
  return datafiles.build(**(config | overrides))


def test_tokenizer_numbers_its_tokens_in_sorted_order(tmp_path):
  lines = ["to be, or not to be: that is the question\n"] * 50 + [
      "whether 'tis nobler in the mind to suffer\n"
  ] * 30
  words = tokenizer.train(lines, 60)
  vocab = sorted(words.get_vocab().items(), key=lambda item: item[1])
  tokens = [t for t, _ in vocab]
  assert tokens[:5] == list(tokenizer.SPECIAL_TOKENS)
  assert tokens[5:] == sorted(tokens[5:])
  assert [i for _, i in vocab] == list(range(len(vocab)))
  assert words.decode(words.encode("To be, or NOT").ids) == "to be, or not"
  path = str(tmp_path / "words.json")
  words.save(path)
  assert tokenizer.load(path).to_str() == words.to_str()


def test_tokenizer_misuse_raises(tmp_path):
  with pytest.raises(ValueError, match="vocab_size must be an int > 5, got 5"):
    tokenizer.train(["a b c\n"], 5)
  # A tokenizer whose special tokens are elsewhere is refused.
  bad = tokenizer.train(["a b c\n"], 20)
  vocab = bad.get_vocab()
  path = tmp_path / "bad.json"
  bad.save(str(path))
  saved = json.loads(path.read_text())
  saved["model"]["vocab"] = {t: len(vocab) - 1 - i for t, i in vocab.items()}
  path.write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=r"\[MASK\] at ids 0-4"):
    tokenizer.load(str(path))


def test_masked_text_masks_fifteen_percent_as_bert(text_path, tmp_path):
  dataset = build(text_path, tmp_path)
  assert dataset.task == "masked_lm" and dataset.num_classes == VOCAB_SIZE
  assert dataset.input_shape == (SEQ_LEN,)
  loader = data.Loader(dataset.train, global_batch=64, seed=0)
  batches = [loader.batch(step) for step in range(20)]
  inputs, targets, weights = (
      np.concatenate([b[k] for b in batches])
      for k in ("inputs", "targets", "weights")
  )
  # round(15% of 32) = 5 predicted positions per sequence.
  np.testing.assert_array_equal(weights.sum(1), 5)
  unmasked = weights == 0
  np.testing.assert_array_equal(inputs[unmasked], targets[unmasked])
  chosen = weights == 1
  mask_id = tokenizer.SPECIAL_TOKENS.index("[MASK]")
  masked = inputs[chosen] == mask_id
  kept = inputs[chosen] == targets[chosen]
  randomized = ~masked & ~kept
  # 6400 predicted positions: 80/10/10 within a few standard deviations.
  assert abs(masked.mean() - 0.8) < 0.03
  assert abs(kept.mean() - 0.1) < 0.02  # a random token may equal the target
  assert abs(randomized.mean() - 0.1) < 0.02
  assert (inputs[chosen][randomized] > mask_id).all()
  assert (targets > mask_id).mean() > 0.98  # few [UNK]s, no [MASK]s
  # A pure function of (seed, step); another seed masks elsewhere.
  np.testing.assert_array_equal(loader.batch(7)["inputs"], batches[7]["inputs"])
  other = data.Loader(dataset.train, global_batch=64, seed=1).batch(7)
  assert not np.array_equal(other["weights"], batches[7]["weights"])
  # Held-out masks are the same on every pass.
  first = next(data.eval_batches(dataset.eval, global_batch=8))
  again = next(data.eval_batches(dataset.eval, global_batch=8))
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])


def test_the_held_out_split_is_the_end_of_the_text(text_path, tmp_path):
  dataset = build(text_path, tmp_path)
  words = tokenizer.load(str(tmp_path / "wordpiece.json"))
  last = dataset.eval.get(np.array([len(dataset.eval) - 1]))["targets"][0]
  with open(text_path, encoding="utf-8") as f:
    tail = f.read()[-2000:].lower()
  # Decoding spaces out punctuation: compare without white space.
  assert "".join(words.decode(last.tolist()).split()) in "".join(tail.split())


def test_the_tokenizer_is_trained_once_then_read(text_path, tmp_path):
  build(text_path, tmp_path)
  path = tmp_path / "wordpiece.json"
  saved = path.read_text()
  os.utime(path, (0, 0))
  build(text_path, tmp_path)
  assert path.read_text() == saved and path.stat().st_mtime == 0
  with pytest.raises(ValueError, match="holds 512 tokens, but config.data"):
    build(text_path, tmp_path, vocab_size=600)


def small_bert_config(text_path, tmp_path, steps):
  config = bert_shakespeare.get_config()
  config.data.path = text_path
  config.data.seq_len = SEQ_LEN
  config.data.vocab_size = VOCAB_SIZE
  config.data.tokenizer = str(tmp_path / "wordpiece.json")
  config.model.size = {"num_layers": 2, "hidden": 64, "heads": 2, "ffn": 128}
  config.model.max_len = SEQ_LEN
  # Rank 4, so that ACP-SGD compresses this small BERT's 64-wide matrices
  # (at the config's rank 32 they would not shrink and would go dense).
  config.compressor.acp_sgd.rank = 4
  config.batch_size = 32
  config.num_train_steps = steps
  config.log_every_steps = 10
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.optimizer.learning_rate = 2e-3
  config.schedule = {
      "name": "cosine",
      "warmup_steps": 10,
      "cosine": {"end_factor": 0.1},
  }
  return config


@pytest.mark.slow
def test_small_bert_held_out_mlm_loss_falls(text_path, tmp_path):
  config = small_bert_config(text_path, tmp_path, 150)
  experiment = experiment_lib.build(config)
  _, eval_fn = train.compile_steps(experiment)
  start = train.evaluate(
      experiment, eval_fn, experiment_lib.init_state(experiment)
  )
  end = train.train_and_evaluate(config, str(tmp_path / "run"))
  print(
      f"held-out MLM loss: {start['eval_loss']:.3f} at the start,"
      f" {end['eval_loss']:.3f} after {end['step']} steps"
  )
  # At the start, near the uniform guess log(512) = 6.24; 150 steps learn
  # about the tokens' frequencies (6.26 -> 5.20 on this text).
  assert start["eval_loss"] > 5.5
  assert end["eval_loss"] < start["eval_loss"] - 0.5
