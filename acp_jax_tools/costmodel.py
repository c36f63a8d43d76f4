"""An alpha-beta model of a data-parallel step, with overlap.

Collectives on ``p`` workers, each with a link of latency ``alpha`` seconds
and ``beta`` seconds per byte (Thakur, Rabenseifner and Gropp, 2005):

  ring all-reduce of B bytes     2 (p - 1) alpha + 2 (p - 1) / p  B beta
  ring all-gather of B per part  (p - 1) alpha + (p - 1) B beta

A step is compute (forward, backward and the compressor's own arithmetic,
measured) plus communication, less what the method can hide behind
backprop. S-SGD and ACP-SGD can: each layer's all-reduce depends only on
that layer's gradient (and, for ACP-SGD, on the factor reduced last step),
so it may run while earlier layers still back-propagate. Power-SGD's second
all-reduce waits for its first, Sign-SGD and Top-k select over whole
tensors: they communicate after backprop. A method's rounds and whether
it pipelines are its registry entry's (``acp_jax.registry.Entry``'s
``rounds`` and ``pipelined``), so a compressor registered there is priced
with no edit here. Whether a runtime does overlap is its own matter
(``overlap``): XLA:CPU runs a step's thunks in order, PyTorch DDP and the
paper's implementation overlap.

Pure arithmetic: ``acp_jax.advise`` predicts with it, and the benchmarks
calibrate and project with it.
"""

from collections.abc import Mapping
import dataclasses

import numpy as np

from acp_jax import compressor as compressor_lib
from acp_jax import registry

# Backward takes about two thirds of forward plus backward (two matrix
# products per forward one).
BACKWARD_SHARE = 2 / 3


@dataclasses.dataclass(frozen=True)
class Link:
  """Per-message latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/B)."""

  alpha: float
  beta: float

  @classmethod
  def ideal(cls, rate_mbit: float, alpha: float) -> "Link":
    """A link moving ``rate_mbit`` megabits per second, with ``alpha``."""
    return cls(alpha, 8 / (rate_mbit * 1e6))


def _check_workers(p: int) -> None:
  if p < 1:
    raise ValueError(f"workers must be positive, got {p}")


def all_reduce_seconds(nbytes: float, p: int, link: Link) -> float:
  """Ring all-reduce of ``nbytes`` on each of ``p`` workers."""
  _check_workers(p)
  if p == 1 or nbytes == 0:
    return 0.0
  return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def all_gather_seconds(part_bytes: float, p: int, link: Link) -> float:
  """Ring all-gather where each of ``p`` workers contributes
  ``part_bytes``."""
  _check_workers(p)
  if p == 1 or part_bytes == 0:
    return 0.0
  return (p - 1) * link.alpha + (p - 1) * part_bytes * link.beta


def fit_all_reduce(sizes, seconds, p: int) -> Link:
  """The link that best explains all-reduce times of ``sizes`` bytes on
  ``p`` workers (least squares on T = a + b B)."""
  _check_workers(p)
  if p == 1:
    raise ValueError("calibration needs at least 2 workers, got 1")
  sizes = np.asarray(sizes, float)
  if len(set(sizes)) < 2:
    raise ValueError(f"calibration needs two sizes or more, got {sizes}")
  b, a = np.polyfit(sizes, np.asarray(seconds, float), 1)
  return Link(alpha=max(a, 0.0) / (2 * (p - 1)), beta=b * p / (2 * (p - 1)))


@dataclasses.dataclass(frozen=True)
class Traffic:
  """What one step sends: ``all_reduce`` bytes (each worker's buffers) in
  ``all_reduce_ops`` collectives, and ``all_gather`` bytes (the gathered
  results, ``p`` parts each) in ``all_gather_ops``. Each collective pays
  its latency; the bytes are split evenly over the ops."""

  all_reduce: float = 0.0
  all_reduce_ops: int = 0
  all_gather: float = 0.0
  all_gather_ops: int = 0

  def __post_init__(self):
    for nbytes, ops in (
        (self.all_reduce, self.all_reduce_ops),
        (self.all_gather, self.all_gather_ops),
    ):
      if nbytes < 0 or ops < 0 or (nbytes > 0 and ops == 0):
        raise ValueError(f"{nbytes} bytes in {ops} collectives: {self}")

  def seconds(self, p: int, link: Link) -> float:
    """Communication time of the step on ``p`` workers."""
    total = 0.0
    if self.all_reduce_ops:
      total += self.all_reduce_ops * all_reduce_seconds(
          self.all_reduce / self.all_reduce_ops, p, link
      )
    if self.all_gather_ops:
      total += self.all_gather_ops * all_gather_seconds(
          self.all_gather / self.all_gather_ops / p, p, link
      )
    return total


def traffic(
    volumes: Mapping[str, compressor_lib.CommVolume], method: str
) -> list[Traffic]:
  """Each phase's ``CommVolume`` (``acp_jax.comm_bytes``) as the ``Traffic``
  of ``method``'s step: its all-reduces fused into its rounds (tensor
  fusion, as XLA's combiner and DDP's buckets do), its all-gathers into
  one."""
  rounds = registry.get(method).rounds
  return [
      Traffic(
          v.all_reduce,
          rounds if v.all_reduce else 0,
          v.all_gather,
          int(v.all_gather > 0),
      )
      for v in volumes.values()
  ]


def step_seconds(
    compute: float,
    backward: float,
    traffic: Traffic,
    method: str,
    p: int,
    link: Link,
    overlap: bool,
) -> float:
  """One step: ``compute`` seconds on one worker (forward, backward and the
  update), plus ``traffic``'s communication, less what a pipelined
  ``method`` hides behind ``backward`` seconds when the runtime
  ``overlap``s."""
  comm = traffic.seconds(p, link)
  pipelined = registry.get(method).pipelined
  hidden = min(comm, backward) if overlap and pipelined else 0.0
  return compute + comm - hidden
