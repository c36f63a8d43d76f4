"""The compressors the advice weighs (``acp_jax.advise``): a registered
compressor's name, and a low-rank one's rank and factor dtype."""

from collections.abc import Sequence
import dataclasses
from typing import Any

import jax

from acp_jax import _checks
from acp_jax import compressor as compressor_lib
from acp_jax import registry

RANKS = (1, 2, 4, 8, 16, 32)
# Backends whose all-reduce sends bfloat16 as it is (XLA:CPU widens it to
# float32, so bfloat16 factors save nothing there).
BFLOAT16_BACKENDS = ("gpu", "tpu")

@dataclasses.dataclass(frozen=True)
class Candidate:
  """A compressor the advice weighs: a registered compressor's name
  (``acp_jax.registry``), and a low-rank one's rank and factor dtype.

  A candidate without a rank is made with its registry entry's configured
  arguments (Top-k with its ``density``); a low-rank one with its ``rank``
  and ``comm_dtype``, the factory's defaults besides.
  """

  method: str
  rank: int | None = None
  comm_dtype: str | None = None

  def __post_init__(self):
    _checks.choice("method", self.method, registry.names())
    low_rank = registry.low_rank()
    if (self.rank is not None) != (self.method in low_rank):
      raise ValueError(
          f"rank is for {' and '.join(low_rank)} only, got rank"
          f" {self.rank!r} for {self.method!r}"
      )

  @property
  def name(self) -> str:
    """``"acp_sgd_r4"``, ``"power_sgd_r8_bf16"``, ``"ssgd"``..."""
    name = self.method if self.rank is None else f"{self.method}_r{self.rank}"
    return name + ("_bf16" if self.comm_dtype == "bfloat16" else "")

  def kwargs(self) -> dict[str, Any]:
    """The factory's arguments that make this candidate: a low-rank one's
    rank and factor dtype, or else the entry's configured values (a type in
    ``Entry.config`` stands for the factory's default, and is left out)."""
    if self.rank is not None:
      return {"rank": self.rank, "comm_dtype": self.comm_dtype}
    config = registry.get(self.method).config
    return {k: v for k, v in config.items() if not isinstance(v, type)}

  def make(self, **kwargs: Any) -> compressor_lib.Compressor:
    """The compressor, with any further factory arguments (``axis_name``,
    ``warmup_steps``...)."""
    factory = registry.get(self.method).factory
    return factory(**self.kwargs(), **kwargs)


def default_candidates(
    backend: str | None = None, ranks: Sequence[int] = RANKS
) -> tuple[Candidate, ...]:
  """Every registered compressor (``acp_jax.registry``), in the order they
  were registered: one without a rank once, and a low-rank one (Power-SGD,
  ACP-SGD) at each of ``ranks`` with factors of the gradients' dtype, and
  with bfloat16 ones too where ``backend`` (default: JAX's) all-reduces
  bfloat16 as it is."""
  backend = backend or jax.default_backend()
  dtypes = (None, "bfloat16") if backend in BFLOAT16_BACKENDS else (None,)
  for r in ranks:
    _checks.integer("rank", r, 1)
  low_rank = registry.low_rank()
  candidates = []
  for name in registry.names():
    if name in low_rank:
      candidates += [Candidate(name, r, d) for r in ranks for d in dtypes]
    else:
      candidates.append(Candidate(name))
  return tuple(candidates)
