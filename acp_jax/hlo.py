"""Collectives and their bytes, read from compiled HLO text.

The only way to know what a step really sends (a hidden dense all-reduce from
``jax.grad`` under ``shard_map``, a collective XLA added or merged) is the
compiled module: ``jax.jit(step).lower(*args).compile().as_text()``.
"""

import collections
import functools
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
_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%[\w.\-]+)\s*=(?P<rest>.*)$"
)
_HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?(?P<name>%[\w.\-]+)\s.*\{\s*$")
_REFERENCE = re.compile(r"%[\w.\-]+")


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


def collective_rounds(hlo_text: str) -> int:
  """Length of the longest chain of collectives that wait on each other.

  A collective is in round k if some path of data dependencies reaches it
  through k - 1 earlier collectives. S-SGD and ACP-SGD need one round
  however many all-reduces XLA splits or merges them into; Power-SGD needs
  two (Q is computed from the reduced P). A round is what a step cannot
  overlap with its own backprop; op counts, by contrast, depend on XLA's
  combiner. Collectives inside a called computation (a fusion, a loop body)
  count once per call.

  Args:
    hlo_text: ``compiled.as_text()`` (or any HLO module text) of a step.

  Returns:
    The number of rounds; 0 without collectives.
  """
  # Lines before any computation header (a bare list of instructions) form
  # a computation of their own, the entry unless the text names one.
  computations: dict[str, list[tuple[str, bool, list[str]]]] = {"": []}
  entry, body = "", computations[""]
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("(")[0]:
      body = computations.setdefault(header["name"], [])
      entry = header["name"] if header["entry"] else entry
      continue
    definition = _DEFINITION.match(line)
    if definition:
      body.append(
          (
              definition["name"],
              _INSTRUCTION.match(line) is not None,
              _REFERENCE.findall(definition["rest"]),
          )
      )

  @functools.cache
  def rounds(computation: str) -> int:
    depth: dict[str, int] = {}
    for name, is_collective, references in computations[computation]:
      called = [r for r in references if r in computations]
      depth[name] = (
          max((depth.get(r, 0) for r in references), default=0)
          + max(map(rounds, called), default=0)
          + is_collective
      )
    return max(depth.values(), default=0)

  return rounds(entry)
