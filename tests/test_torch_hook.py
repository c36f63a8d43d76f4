"""PyTorch's PowerSGD hook as the overhead benchmark runs it: one process,
one bucket, past the dense start."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import torch_hook  # pylint: disable=g-import-not-at-top


def _params():
  return {
      "conv": {"kernel": jax.ShapeDtypeStruct((3, 3, 8, 16), np.float32)},
      "dense": {
          "kernel": jax.ShapeDtypeStruct((64, 32), np.float32),
          "bias": jax.ShapeDtypeStruct((32,), np.float32),
      },
      "embed": {"embedding": jax.ShapeDtypeStruct((100, 24), np.float32)},
  }


def test_torch_layouts_put_a_kernels_output_axis_first():
  assert torch_hook.torch_shapes(_params()) == [
      (16, 3, 3, 8),
      (32,),
      (32, 64),
      (100, 24),
  ]


def test_each_call_compresses_at_the_rank_and_keeps_the_residual():
  step = torch_hook.PowerSGDStep(
      _params(), rank=2, min_compression_rate=2.0, threads=1
  )
  assert step.state.iter > torch_hook.START_ITER
  bias = step.bucket.gradients()[1].clone()
  step()
  conv, bias_after, dense, embed = step.bucket.gradients()
  # One process: the dense bias's mean is itself; the matrices come back
  # as their rank-2 approximations (the conv weight as 16 x 72).
  torch.testing.assert_close(bias_after, bias)
  for grad in (conv, dense, embed):
    matrix = grad.reshape(grad.shape[0], -1)
    assert torch.linalg.matrix_rank(matrix) == 2
  assert torch.count_nonzero(step.state.error_dict[0]) > 0
