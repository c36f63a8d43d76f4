"""Collectives and their bytes, read from compiled HLO text.

The only way to know what a step really sends (a hidden dense all-reduce from
``jax.grad`` under ``shard_map``, a collective XLA added or merged) is the
compiled module: ``jax.jit(step).lower(*args).compile().as_text()``.
"""

import collections
import re
from typing import NamedTuple

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
    rf"(?P<op>{'|'.join(_OPS)})(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}


class CollectiveStats(NamedTuple):
  """How many collectives of one kind a module runs, and their result bytes."""

  count: int
  bytes: int


def _array_bytes(shape_text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in _ITEMSIZE:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape_text!r}")
    numel = 1
    for d in filter(None, dims.split(",")):
      numel *= int(d)
    sizes.append(numel * _ITEMSIZE[dtype])
  return sizes


def collective_stats(hlo_text: str) -> dict[str, CollectiveStats]:
  """Count and result bytes of each kind of collective in an HLO module.

  A collective's bytes are its result's: the buffer for an all-reduce, what a
  device receives for an all-gather (the axis size times its operand). Async
  pairs (``all-gather-start`` / ``-done`` on GPU) count once.

  Args:
    hlo_text: ``compiled.as_text()`` of a jitted step.

  Returns:
    ``{kind: CollectiveStats}`` for each kind present, e.g. ``"all-reduce"``.
  """
  count = collections.Counter()
  nbytes = collections.Counter()
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    sizes = _array_bytes(match["shape"])
    if match["start"] and match["op"] in ("all-gather", "collective-permute"):
      # The async start returns (operands..., results...).
      sizes = sizes[len(sizes) // 2:]
    count[match["op"]] += 1
    nbytes[match["op"]] += sum(sizes)
  return {op: CollectiveStats(count[op], nbytes[op]) for op in count}
