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


class CollectiveStats(NamedTuple):
  """How many collectives of one kind a module runs, and their result bytes."""

  count: int
  bytes: int


def _itemsize(element_type: str) -> int:
  """Bytes of an HLO element type: pred, s8, bf16, f32, c64, f8e4m3fn..."""
  if element_type == "pred":
    return 1
  bits = re.search(r"[0-9]+", element_type)
  if bits is None or int(bits.group()) % 8:
    raise ValueError(f"unknown HLO element type {element_type!r}")
  return int(bits.group()) // 8


def _array_bytes(shape_text: str) -> list[int]:
  sizes = []
  for element_type, dims in _ARRAY.findall(shape_text):
    numel = 1
    for d in filter(None, dims.split(",")):
      numel *= int(d)
    sizes.append(numel * _itemsize(element_type))
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
      sizes = sizes[len(sizes) // 2 :]
    count[match["op"]] += 1
    nbytes[match["op"]] += sum(sizes)
  return {op: CollectiveStats(count[op], nbytes[op]) for op in count}
