"""The text of a compiled HLO module, parsed: its computations, their
instructions, and the bytes of a shape (what ``acp_jax_tools.hlo`` reads)."""

import math
import re
from typing import NamedTuple

# The collectives, by the opcode of their synchronous form.
OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<operands>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?(?P<name>%[\w.\-]+)\s.*\{\s*$")
_REFERENCE = re.compile(r"%[\w.\-]+")
# Scheduling constraints, not data: a collective may still overlap them.
_CONTROL = re.compile(r"control-predecessors=\{[^}]*\}")


class Instruction(NamedTuple):
  """One instruction of a computation, as printed."""

  name: str
  op: str  # the opcode: "fusion", "all-reduce-start", ...
  shape: str  # the result's shape text
  references: tuple[str, ...]  # operands and called computations


def _itemsize(element_type: str) -> int:
  """Bytes of an HLO element type: pred, s8, bf16, f32, c64, f8e4m3fn..."""
  if element_type == "pred":
    return 1
  bits = re.search(r"[0-9]+", element_type)
  if bits is None or int(bits.group()) % 8:
    raise ValueError(f"unknown HLO element type {element_type!r}")
  return int(bits.group()) // 8


def _array_bytes(arrays: list[tuple[str, str]]) -> int:
  """Bytes of ``(element type, dims)`` pairs, as ``_ARRAY`` finds them."""
  return sum(
      _numel(dims) * _itemsize(element_type) for element_type, dims in arrays
  )


def _numel(dims: str) -> int:
  """Elements of an array whose dims are printed as ``dims``: "8,128"."""
  return math.prod(int(d) for d in filter(None, dims.split(",")))


def shape_bytes(shape_text: str) -> int:
  """Bytes of a shape, summed over the arrays of a tuple."""
  return _array_bytes(_ARRAY.findall(shape_text))


def collective_kind(op: str) -> str | None:
  """The collective an opcode runs (an async start is its collective), or
  None; the matching "-done" is not one."""
  kind = op.removesuffix("-start")
  return kind if kind in OPS else None


def collective_bytes(op: str, shape_text: str) -> int:
  """Result bytes of a collective: what a device holds after it."""
  arrays = _ARRAY.findall(shape_text)
  if op == "collective-permute-start" and arrays[-2:] == [("u32", "")] * 2:
    arrays = arrays[:-2]  # two u32[] context scalars
  if op in ("all-gather-start", "collective-permute-start"):
    # The async start returns (operands..., results...).
    arrays = arrays[len(arrays) // 2 :]
  return _array_bytes(arrays)


def computations(hlo_text: str) -> tuple[str, dict[str, list[Instruction]]]:
  """The module's computations, by name, and the name of its entry.

  Lines before any computation header (a bare list of instructions) form a
  computation of their own, named "", the entry unless the text names one.
  """
  computations: dict[str, list[Instruction]] = {"": []}
  entry, body = "", computations[""]
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("(")[0]:
      body = computations.setdefault(header["name"], [])
      entry = header["name"] if header["entry"] else entry
      continue
    match = INSTRUCTION.match(line)
    if match:
      operands = _CONTROL.sub("", match["operands"])
      body.append(
          Instruction(
              match["name"],
              match["op"],
              match["shape"],
              tuple(_REFERENCE.findall(operands)),
          )
      )
  return entry, computations


def elements(shape_text: str) -> list[int]:
  """Element counts of the arrays in a shape (several for a tuple)."""
  return [_numel(dims) for _, dims in _ARRAY.findall(shape_text)]
