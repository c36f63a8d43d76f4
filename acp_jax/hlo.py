"""Collectives, their bytes and their place in the step, read from HLO text.

The only way to know what a step really sends (a hidden dense all-reduce from
``jax.grad`` under ``shard_map``, a collective XLA added or merged) is the
compiled module: ``jax.jit(step).lower(*args).compile().as_text()``. The same
text holds the step's dependency graph, which says which collectives wait on
each other (``collective_rounds``), how much of the step's computation a
collective could run beside (``overlap_potential``) and, once XLA:GPU has
scheduled it, what each collective does run beside (``scheduled_overlap``).
"""

import collections
import functools
import re
from typing import Any, Callable, NamedTuple

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
# The instructions a step's time goes into (XLA fuses elementwise work);
# parameters, tuples, bitcasts, copies and collectives cost nothing here.
_COMPUTE = frozenset((
    "fusion",
    "dot",
    "convolution",
    "custom-call",
    "call",
    "while",
    "conditional",
))
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<operands>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?(?P<name>%[\w.\-]+)\s.*\{\s*$")
_REFERENCE = re.compile(r"%[\w.\-]+")
# Scheduling constraints, not data: a collective may still overlap them.
_CONTROL = re.compile(r"control-predecessors=\{[^}]*\}")


class CollectiveStats(NamedTuple):
  """How many collectives of one kind a module runs, and their result bytes."""

  count: int
  bytes: int


class CollectiveOverlap(NamedTuple):
  """One collective of a step and the computation it could run beside.

  The shares are of the step's compute cost (see ``overlap_potential``).
  ``independent_share``, ``ancestor_share`` and ``descendant_share`` add up
  to 1 when the step has any compute.
  """

  name: str  # the instruction, as printed: "%all-reduce.3"
  kind: str  # "all-reduce", ...; an async "-start" goes by its kind
  bytes: int  # its result bytes, as collective_stats counts them
  round: int  # as in collective_rounds: 1 + collectives on a path into it
  independent_share: float  # compute neither before nor after it
  ancestor_share: float  # compute it waits for
  descendant_share: float  # compute that waits for it
  # The part of independent_share upstream of some collective (forward,
  # backward, compression): the backprop it could hide behind, as opposed
  # to work done after the exchanges (optimizer, error feedback).
  upstream_share: float


class OverlapReport(NamedTuple):
  """What ``overlap_potential`` reads from a step."""

  collectives: tuple[CollectiveOverlap, ...]  # in the order of the text
  bytes_weighted_potential: float  # of independent_share
  bytes_weighted_upstream_potential: float  # of upstream_share
  compute_bytes: int  # the output bytes of all compute instructions


class _Instruction(NamedTuple):
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
  total = 0
  for element_type, dims in arrays:
    numel = 1
    for d in filter(None, dims.split(",")):
      numel *= int(d)
    total += numel * _itemsize(element_type)
  return total


def _shape_bytes(shape_text: str) -> int:
  """Bytes of a shape, summed over the arrays of a tuple."""
  return _array_bytes(_ARRAY.findall(shape_text))


def _collective_kind(op: str) -> str | None:
  """The collective an opcode runs (an async start is its collective), or
  None; the matching "-done" is not one."""
  kind = op.removesuffix("-start")
  return kind if kind in _OPS else None


def _collective_bytes(op: str, shape_text: str) -> int:
  """Result bytes of a collective: what a device holds after it."""
  arrays = _ARRAY.findall(shape_text)
  if op == "collective-permute-start" and arrays[-2:] == [("u32", "")] * 2:
    arrays = arrays[:-2]  # two u32[] context scalars
  if op in ("all-gather-start", "collective-permute-start"):
    # The async start returns (operands..., results...).
    arrays = arrays[len(arrays) // 2 :]
  return _array_bytes(arrays)


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
    kind = match and _collective_kind(match["op"])
    if kind:
      count[kind] += 1
      nbytes[kind] += _collective_bytes(match["op"], match["shape"])
  return {op: CollectiveStats(count[op], nbytes[op]) for op in count}


def traffic(compiled: Any) -> dict[str, CollectiveStats]:
  """What a compiled program sends, by collective: ``collective_stats`` of
  its text, with every kind (``"all-reduce"``, ``"all-gather"``,
  ``"reduce-scatter"``, ``"all-to-all"``, ``"collective-permute"``) present,
  zero where it runs none.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
      or its ``as_text()``.
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  stats = collective_stats(text)
  return {kind: stats.get(kind, CollectiveStats(0, 0)) for kind in _OPS}


def _computations(hlo_text: str) -> tuple[str, dict[str, list[_Instruction]]]:
  """The module's computations, by name, and the name of its entry.

  Lines before any computation header (a bare list of instructions) form a
  computation of their own, named "", the entry unless the text names one.
  """
  computations: dict[str, list[_Instruction]] = {"": []}
  entry, body = "", computations[""]
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("(")[0]:
      body = computations.setdefault(header["name"], [])
      entry = header["name"] if header["entry"] else entry
      continue
    match = _INSTRUCTION.match(line)
    if match:
      operands = _CONTROL.sub("", match["operands"])
      body.append(
          _Instruction(
              match["name"],
              match["op"],
              match["shape"],
              tuple(_REFERENCE.findall(operands)),
          )
      )
  return entry, computations


class BufferPass(NamedTuple):
  """An instruction of a module's entry that reads or writes whole arrays of
  a given size (see ``buffer_passes``)."""

  name: str  # the instruction, as printed: "%fusion.3"
  op: str  # its opcode: "fusion", "copy", "dot", ...
  reads: int  # operands of that size
  writes: int  # results of that size


# What moves no data: a bitcast reinterprets a buffer, the others name one.
_NO_PASS = frozenset(
    ("parameter", "bitcast", "get-tuple-element", "tuple", "constant")
)


def _elements(shape_text: str) -> list[int]:
  """Element counts of the arrays in a shape (several for a tuple)."""
  counts = []
  for _, dims in _ARRAY.findall(shape_text):
    numel = 1
    for d in filter(None, dims.split(",")):
      numel *= int(d)
    counts.append(numel)
  return counts


def buffer_passes(hlo_text: str, elements: int) -> list[BufferPass]:
  """The entry's instructions that pass over arrays of ``elements`` elements.

  On a memory-bound step, such as a compressor's error feedback on a large
  matrix, each read or write of the whole matrix costs about the same, so
  their number says how the step's arithmetic was fused: a temporary the
  compiler could not fuse away shows up as one write and one read more, a
  layout copy as a read and a write.

  Args:
    hlo_text: a compiled module (``compiled.as_text()``).
    elements: the size of the arrays to count, e.g. ``n * m``.

  Returns:
    One ``BufferPass`` per instruction that reads or writes such an array,
    in the order of the text; bitcasts, parameters and tuples move nothing
    and are left out.
  """
  entry, computations = _computations(hlo_text)
  sizes: dict[str, list[int]] = {}
  passes = []
  for ins in computations[entry]:
    sizes[ins.name] = _elements(ins.shape)
    if ins.op in _NO_PASS:
      continue
    reads = sum(sizes.get(ref, []).count(elements) for ref in ins.references)
    writes = sizes[ins.name].count(elements)
    if reads or writes:
      passes.append(BufferPass(ins.name, ins.op, reads, writes))
  return passes


def _rounds(
    computations: dict[str, list[_Instruction]],
) -> Callable[[str], dict[str, int]]:
  """For a computation's name, the round of each of its instructions: the
  most collectives on a data path up to and including it. A call adds the
  rounds of the computations it calls."""

  @functools.cache
  def rounds(computation: str) -> dict[str, int]:
    depth: dict[str, int] = {}
    for instruction in computations[computation]:
      references = instruction.references
      called = [r for r in references if r in computations]
      depth[instruction.name] = (
          max((depth.get(r, 0) for r in references), default=0)
          + max((max(rounds(c).values(), default=0) for c in called), default=0)
          + (_collective_kind(instruction.op) is not None)
      )
    return depth

  return rounds


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
  entry, computations = _computations(hlo_text)
  return max(_rounds(computations)(entry).values(), default=0)


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
  """Every instruction reachable from ``start`` along ``edges``."""
  seen: set[str] = set()
  stack = [start]
  while stack:
    for name in edges[stack.pop()]:
      if name not in seen:
        seen.add(name)
        stack.append(name)
  return seen


def overlap_potential(hlo_text: str) -> OverlapReport:
  """How much of a step's computation each of its collectives could run beside.

  XLA:CPU runs a step's instructions one after another, a collective
  included, so timing on a CPU cannot show communication hiding behind
  backprop. The program's structure can: a collective can only run
  concurrently with computation that is neither among its ancestors (it
  needs their results) nor among its descendants (they need its result).
  This is the independence that XLA:GPU's latency-hiding scheduler uses when
  it issues an ``all-reduce-start`` early and waits for its ``-done`` late; a
  packed buffer that depends on every gradient has none of it during
  backprop.

  For each collective of the entry computation (an async start and its done
  are one), the compute instructions of the entry computation (fusions,
  dots, convolutions, custom-calls, calls, whiles and conditionals) are
  split into its ancestors, its descendants and the rest, along data
  dependencies (an instruction that calls a computation depends on the
  call's operands; control dependencies are left out). The rest is its
  overlap potential; the part of it upstream of some collective (an
  ancestor of one) is the backprop it could hide behind, the remainder work
  after the exchanges, such as another leaf's optimizer update or an error
  feedback residual that needs only local values.

  Each instruction is weighed by its output bytes, read from its shape:
  robust, where FLOPs would need each fusion's body, but blind to the work
  inside a loop or a call. Collectives inside called computations are not
  listed: they run within their caller.

  Args:
    hlo_text: ``compiled.as_text()`` of a jitted step. Compile with
      ``compiler_options={"xla_disable_hlo_passes":
      "cpu-all-reduce-combiner"}`` to see XLA:CPU's all-reduces one by one;
      its combiner merges them all into one.

  Returns:
    An ``OverlapReport``: each collective's shares of the compute cost, and
    their means weighted by the collectives' bytes (0 without collectives or
    compute).

  Example::

    text = jax.jit(train_step).lower(*args).compile().as_text()
    for c in acp_jax.overlap_potential(text).collectives:
      print(c.name, c.bytes, f"{c.independent_share:.0%}")
  """
  entry, computations = _computations(hlo_text)
  instructions = computations[entry]
  names = {instruction.name for instruction in instructions}
  operands = {
      i.name: [r for r in i.references if r in names] for i in instructions
  }
  users: dict[str, list[str]] = {name: [] for name in names}
  for name, inputs in operands.items():
    for operand in inputs:
      users[operand].append(name)
  cost = {
      i.name: _shape_bytes(i.shape) for i in instructions if i.op in _COMPUTE
  }
  total = sum(cost.values())
  share = lambda subset: (
      sum(cost.get(name, 0) for name in subset) / total if total else 0.0
  )
  rounds = _rounds(computations)(entry)

  collectives = [i for i in instructions if _collective_kind(i.op)]
  ancestors = {i.name: _closure(i.name, operands) for i in collectives}
  upstream = set().union(*ancestors.values())
  reports = []
  for instruction in collectives:
    before = ancestors[instruction.name]
    after = _closure(instruction.name, users)
    independent = names - before - after - {instruction.name}
    reports.append(
        CollectiveOverlap(
            name=instruction.name,
            kind=_collective_kind(instruction.op),
            bytes=_collective_bytes(instruction.op, instruction.shape),
            round=rounds[instruction.name],
            independent_share=share(independent),
            ancestor_share=share(before),
            descendant_share=share(after),
            upstream_share=share(independent & upstream),
        )
    )

  sent = sum(r.bytes for r in reports)
  mean = lambda field: (
      sum(r.bytes * getattr(r, field) for r in reports) / sent if sent else 0.0
  )
  return OverlapReport(
      tuple(reports), mean("independent_share"), mean("upstream_share"), total
  )


class ScheduledCollective(NamedTuple):
  """An async collective of a scheduled module and what runs while it flies."""

  name: str  # its start, as printed: "%all-reduce-start.3"
  kind: str  # "all-reduce", "all-gather" or "collective-permute"
  bytes: int  # its result bytes, as collective_stats counts them
  done: str  # the matching "-done" instruction
  compute_between: int  # compute instructions scheduled between the two


def scheduled_overlap(hlo_text: str) -> list[ScheduledCollective]:
  """What each async collective of a scheduled module brackets.

  ``overlap_potential`` reads what a collective *could* run beside; this
  reads what the compiler scheduled beside it. XLA:GPU splits a collective
  into a ``-start`` and a ``-done`` and its latency-hiding scheduler
  (``--xla_gpu_enable_latency_hiding_scheduler=true``) moves independent
  work between them; the printed order of the entry computation of
  ``compiled.as_text()`` is the order it runs in. For each start of the
  entry computation, this counts the compute instructions (fusions, dots,
  convolutions, custom-calls such as cuBLAS gemms and cuDNN convolutions,
  calls, whiles and conditionals) printed between it and its done: none
  means the step waits for the whole transfer.

  Synchronous collectives (XLA:CPU's, or a GPU collective the compiler kept
  synchronous) and collectives wrapped in a generic ``async-start`` are not
  listed.

  Args:
    hlo_text: ``compiled.as_text()`` of a step compiled for GPUs (a mock
      topology on one GPU will do: ``jax.config.update(
      "jax_mock_gpu_topology", "1x1x8")`` before the backend starts).

  Returns:
    One ``ScheduledCollective`` per start, in the order of the text.

  Raises:
    ValueError: a start has no done in the entry computation.

  Example::

    text = jax.jit(train_step).lower(*args).compile().as_text()
    for c in acp_jax.scheduled_overlap(text):
      print(c.name, c.bytes, c.compute_between)
  """
  entry, computations = _computations(hlo_text)
  instructions = computations[entry]
  done_at = {
      i.references[0]: (position, i.name)
      for position, i in enumerate(instructions)
      if i.op.endswith("-done") and i.references
  }
  out = []
  for position, instruction in enumerate(instructions):
    if not instruction.op.endswith("-start"):
      continue
    kind = _collective_kind(instruction.op)
    if kind is None:
      continue
    if instruction.name not in done_at:
      raise ValueError(
          f"{instruction.name} ({instruction.op}) has no matching done in"
          " the entry computation"
      )
    end, done = done_at[instruction.name]
    out.append(
        ScheduledCollective(
            name=instruction.name,
            kind=kind,
            bytes=_collective_bytes(instruction.op, instruction.shape),
            done=done,
            compute_between=sum(
                i.op in _COMPUTE for i in instructions[position + 1 : end]
            ),
        )
    )
  return out
