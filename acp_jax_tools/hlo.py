"""Collectives, their bytes and their place in the step, read from HLO text.

The only way to know what a step really sends (a hidden dense all-reduce from
``jax.grad`` under ``shard_map``, a collective XLA added or merged) is the
compiled module: ``jax.jit(step).lower(*args).compile().as_text()``. The same
text holds the step's dependency graph, which says which collectives wait on
each other (``collective_rounds``), how much of the step's computation a
collective could run beside (``overlap_potential``) and, once XLA:GPU has
scheduled it, what each collective does run beside (``scheduled_overlap``).
The parsing of the text, which every reader here shares, is
``acp_jax_tools._hlo_text``; the readers stay one module, since each answers
one question about the same parsed graph.
"""

import collections
import functools
from typing import Any, Callable, NamedTuple

from acp_jax_tools import _hlo_text

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
    match = _hlo_text.INSTRUCTION.match(line)
    kind = match and _hlo_text.collective_kind(match["op"])
    if kind:
      count[kind] += 1
      nbytes[kind] += _hlo_text.collective_bytes(match["op"], match["shape"])
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
  return {
      kind: stats.get(kind, CollectiveStats(0, 0)) for kind in _hlo_text.OPS
  }


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
  entry, computations = _hlo_text.computations(hlo_text)
  sizes: dict[str, list[int]] = {}
  passes = []
  for ins in computations[entry]:
    sizes[ins.name] = _hlo_text.elements(ins.shape)
    if ins.op in _NO_PASS:
      continue
    reads = sum(sizes.get(ref, []).count(elements) for ref in ins.references)
    writes = sizes[ins.name].count(elements)
    if reads or writes:
      passes.append(BufferPass(ins.name, ins.op, reads, writes))
  return passes


def _rounds(
    computations: dict[str, list[_hlo_text.Instruction]],
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
          + (_hlo_text.collective_kind(instruction.op) is not None)
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
  entry, computations = _hlo_text.computations(hlo_text)
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

    from acp_jax_tools import hlo

    text = jax.jit(train_step).lower(*args).compile().as_text()
    for c in hlo.overlap_potential(text).collectives:
      print(c.name, c.bytes, f"{c.independent_share:.0%}")
  """
  entry, computations = _hlo_text.computations(hlo_text)
  instructions = computations[entry]
  graph = _graph(instructions)
  cost = {
      i.name: _hlo_text.shape_bytes(i.shape)
      for i in instructions
      if i.op in _COMPUTE
  }
  total = sum(cost.values())
  share = lambda subset: (
      sum(cost.get(name, 0) for name in subset) / total if total else 0.0
  )
  rounds = _rounds(computations)(entry)
  collectives = [i for i in instructions if _hlo_text.collective_kind(i.op)]
  ancestors = {i.name: _closure(i.name, graph.operands) for i in collectives}
  upstream = set().union(*ancestors.values())
  reports = tuple(
      _collective_overlap(
          i, graph, ancestors[i.name], upstream, share, rounds[i.name]
      )
      for i in collectives
  )
  return OverlapReport(
      reports,
      _bytes_weighted(reports, "independent_share"),
      _bytes_weighted(reports, "upstream_share"),
      total,
  )


class _Graph(NamedTuple):
  """The data dependencies among one computation's instructions."""

  names: set[str]
  operands: dict[str, list[str]]  # the instructions each one reads
  users: dict[str, list[str]]  # the instructions that read each one


def _graph(instructions: list[_hlo_text.Instruction]) -> _Graph:
  """The dependencies of ``instructions`` on each other (references to
  called computations and to other computations' values left out)."""
  names = {instruction.name for instruction in instructions}
  operands = {
      i.name: [r for r in i.references if r in names] for i in instructions
  }
  users: dict[str, list[str]] = {name: [] for name in names}
  for name, inputs in operands.items():
    for operand in inputs:
      users[operand].append(name)
  return _Graph(names, operands, users)


def _collective_overlap(
    instruction: _hlo_text.Instruction,
    graph: _Graph,
    before: set[str],
    upstream: set[str],
    share: Callable[[set[str]], float],
    round_: int,
) -> CollectiveOverlap:
  """One collective's shares: of the compute it waits for (``before``, its
  ancestors), of the compute that waits for it, and of the rest, whose part
  in ``upstream`` (the ancestors of any collective) is backprop."""
  after = _closure(instruction.name, graph.users)
  independent = graph.names - before - after - {instruction.name}
  return CollectiveOverlap(
      name=instruction.name,
      kind=_hlo_text.collective_kind(instruction.op),
      bytes=_hlo_text.collective_bytes(instruction.op, instruction.shape),
      round=round_,
      independent_share=share(independent),
      ancestor_share=share(before),
      descendant_share=share(after),
      upstream_share=share(independent & upstream),
  )


def _bytes_weighted(
    reports: tuple[CollectiveOverlap, ...], field: str
) -> float:
  """The mean of a share over ``reports``, weighted by their bytes (0 when
  they send none)."""
  sent = sum(r.bytes for r in reports)
  if not sent:
    return 0.0
  return sum(r.bytes * getattr(r, field) for r in reports) / sent


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
  synchronous) and collectives inside a generic ``async-start`` are not
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

    from acp_jax_tools import hlo

    text = jax.jit(train_step).lower(*args).compile().as_text()
    for c in hlo.scheduled_overlap(text):
      print(c.name, c.bytes, c.compute_between)
  """
  entry, computations = _hlo_text.computations(hlo_text)
  instructions = computations[entry]
  done_at = {
      i.references[0]: (position, i.name)
      for position, i in enumerate(instructions)
      if i.op.endswith("-done") and i.references
  }
  return [
      _scheduled(instructions, position, done_at)
      for position, i in enumerate(instructions)
      if i.op.endswith("-start")
      and _hlo_text.collective_kind(i.op) is not None
  ]


def _scheduled(
    instructions: list[_hlo_text.Instruction],
    position: int,
    done_at: dict[str, tuple[int, str]],
) -> ScheduledCollective:
  """The async collective that starts at ``position``, and the compute
  printed between it and its done (``done_at``: a done's position and name,
  by the start it ends)."""
  start = instructions[position]
  if start.name not in done_at:
    raise ValueError(
        f"{start.name} ({start.op}) has no matching done in"
        " the entry computation"
    )
  end, done = done_at[start.name]
  return ScheduledCollective(
      name=start.name,
      kind=_hlo_text.collective_kind(start.op),
      bytes=_hlo_text.collective_bytes(start.op, start.shape),
      done=done,
      compute_between=sum(
          i.op in _COMPUTE for i in instructions[position + 1 : end]
      ),
  )
