"""PyTorch's PowerSGD on a model's gradient shapes: the reference that
``python -m benchmarks overhead`` times beside acp_jax's compressors.

``powerSGD_hook`` is DDP's communication hook. Here it runs in one process,
in a gloo group of world size 1 whose all-reduces move nothing, on one
bucket that holds every gradient (as acp_jax's Power-SGD packs each round
into one buffer on CPU), so its time is its compression and decompression:
error feedback, the products P = MQ, Q = M^T P and the reconstruction
P Q^T, the orthogonalization of the factors (``torch.linalg.qr``, i.e.
Householder QR in MKL's LAPACK, for float32 at rank > 2; Gram-Schmidt below),
and the copies in and out of the bucket.

The tensors take PyTorch's layouts (a Linear weight is flax's kernel
transposed, a conv weight (out, in, kh, kw)); the hook views each as
(shape[0], -1), acp_jax as (product of the leading dims, last dim): the
same matrix or its transpose, at the same rank.
"""

from typing import Any

import jax
import numpy as np
import torch
from torch import distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

# With error feedback the hook refuses to start compressing before its
# second step; each call below is one step of one bucket.
START_ITER = 2


class _Bucket:
  """What ``powerSGD_hook`` reads of DDP's ``GradBucket``: one bucket, the
  last of its step, whose gradients are views into its flat buffer."""

  def __init__(self, shapes: list[tuple[int, ...]], seed: int):
    sizes = [int(np.prod(s)) for s in shapes]
    rng = np.random.default_rng(seed)
    self._buffer = torch.from_numpy(
        rng.standard_normal(sum(sizes), np.float32)
    )
    self._gradients = [
        part.view(shape)
        for part, shape in zip(torch.split(self._buffer, sizes), shapes)
    ]

  def buffer(self) -> torch.Tensor:
    return self._buffer

  def gradients(self) -> list[torch.Tensor]:
    return self._gradients

  def index(self) -> int:
    return 0

  def is_last(self) -> bool:
    return True


def torch_shapes(params: Any) -> list[tuple[int, ...]]:
  """PyTorch's layout of each of flax's params: a kernel's output axis
  first, everything else as it is."""
  shapes = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    shape = tuple(x.shape)
    if jax.tree_util.keystr(path).endswith("['kernel']") and len(shape) > 1:
      shape = (shape[-1],) + shape[:-1]
    shapes.append(shape)
  return shapes


def _process_group() -> None:
  if not dist.is_initialized():
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1
    )


class PowerSGDStep:
  """One step of ``powerSGD_hook`` per call (error feedback and warm start
  on, as PyTorch's defaults) on gradients shaped like ``params``, past its
  uncompressed start, on ``threads`` threads (``torch.set_num_threads``,
  which MKL's BLAS and LAPACK follow too).

  The bucket keeps what the previous call left in it (the decompressed
  mean), as DDP's buffer would be overwritten by the next backward: the
  hook's arithmetic does not depend on the values.
  """

  def __init__(
      self,
      params: Any,
      rank: int,
      min_compression_rate: float,
      threads: int,
      seed: int = 0,
  ):
    self.threads = threads
    torch.set_num_threads(threads)
    _process_group()
    self.state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=START_ITER,
        min_compression_rate=min_compression_rate,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    self.bucket = _Bucket(torch_shapes(params), seed)
    while self.state.iter <= START_ITER:  # the dense steps, then the first
      self()  # compressed one allocates the factors and residual

  def __call__(self) -> None:
    # Set on every call: steps of another thread count may take turns.
    torch.set_num_threads(self.threads)
    powerSGD_hook.powerSGD_hook(self.state, self.bucket).wait()
