"""The trainer's char LM in PyTorch (``benchmarks.torch_quality``), for
PyTorch DDP's time to quality (its run across a shaped link:
``tests/test_quality.py``)."""

import numpy as np
import pytest

from benchmarks import convergence

torch = pytest.importorskip("torch")


def _text(tmp_path):
  text = tmp_path / "text.txt"
  line = "the quick brown fox jumps over the lazy dog and sits on a mat\n"
  text.write_text(line * 3000)
  return text


def test_the_torch_char_lm_computes_the_trainers_logits(tmp_path):
  """Given the flax model's params, the PyTorch model's logits are the
  flax model's: the same layers, GELU, LayerNorm epsilon and causal mask."""
  from flax import nnx

  from benchmarks import torch_quality
  from train import experiment

  cfg = convergence.config("char_lm", "ssgd", str(_text(tmp_path)), True, 3)
  built = experiment.build(cfg)
  flax_model = built.create_model()
  params = nnx.to_pure_dict(nnx.state(flax_model, nnx.Param))
  model = torch_quality.torch_model(cfg, built.dataset.num_classes, params)
  tokens = built.dataset.train.get(np.arange(4))["inputs"]
  want = np.asarray(flax_model(tokens, train=False))
  with torch.no_grad():
    got = model(torch.from_numpy(np.asarray(tokens, np.int64))).numpy()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
