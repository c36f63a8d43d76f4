"""The overlapped step: each segment's exchange beside the rest of backprop.

The fused step, one jitted program, leaves overlap to XLA. On GPUs, XLA's
asynchronous collectives and latency-hiding scheduler do it. XLA:CPU does
not: its all-reduce blocks, a program's collectives run one after another,
and its combiner merges them into one that waits for every gradient.
Programs dispatched apart, though, run side by side, so this module splits
a step into programs, as PyTorch DDP's reducer splits backprop:

- one forward program runs the blocks and keeps ``jax.vjp``'s residuals;
- one backward program per block, last block first, returns the gradients
  of the params it completes: a segment;
- each segment's exchange (``DataParallel.compress`` of its leaves and their
  share of the compressor's state) goes to the communication thread, which
  dispatches in the same order on every process, while the next block's
  backward pass runs;
- one update program waits for them all and runs ``tx`` on the mean.

The state is ``chain(tx)``'s, and the result is the fused step's to float32
rounding: every compressor treats each leaf on its own, so the leaves can be
exchanged in any grouping.

The blocks are ``DataParallel.step``'s. A param read by several blocks (tied
embeddings) is exchanged with the segment of the first block that reads it.

It relies on two things of the runtime, which ``tests/test_overlap_step.py``
checks by name: that ``jax.jit`` dispatch from a second Python thread runs
beside the first thread's programs on XLA:CPU, and
``jaxlib.xla_client.execution_stream_id`` (PJRT orders a launch only after
the earlier launches of its device and stream).
"""

from collections.abc import Callable, Sequence
import concurrent.futures
import dataclasses
import logging
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from acp_jax import phase as phase_lib

# The stream the communication thread's programs are launched on.
COMM_STREAM = 1
_LOG = logging.getLogger(__name__)


def stream_context() -> Any:
  """The context under which the communication thread dispatches: its own
  execution stream where jaxlib has them (``execution_stream_id``)."""
  from jaxlib import xla_client

  return xla_client.execution_stream_id(COMM_STREAM)


def reads(block: Callable, params: Any, carry: Any, batch: tuple) -> set[int]:
  """The indices of the leaves of ``params`` that ``block`` reads, from its
  jaxpr: an input that no equation takes and no output is is not read."""
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(
      lambda leaves, carry, batch: block(
          treedef.unflatten(leaves), carry, *batch
      )
  )(leaves, carry, batch)
  jaxpr = closed.jaxpr
  used = {
      v
      for eqn in jaxpr.eqns
      for v in eqn.invars
      if not isinstance(v, jax.extend.core.Literal)
  }
  used.update(
      v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)
  )
  return {i for i, v in enumerate(jaxpr.invars[: len(leaves)]) if v in used}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which block's backward pass completes each leaf's gradient.

  Attributes:
    reads: per block, the sorted indices of the leaves it reads.
    segments: per block, the leaves whose gradient its backward pass
      completes (those the block is the first to read; block 0's also
      holds the leaves no block reads, whose gradient is zero).
  """

  reads: tuple[tuple[int, ...], ...]
  segments: tuple[tuple[int, ...], ...]

  @property
  def num_exchanges(self) -> int:
    return sum(bool(s) for s in self.segments)


def plan(blocks: Sequence[Callable], params: Any, batch: tuple) -> Plan:
  """The segments of ``blocks`` on ``params`` and one device's ``batch``
  (arrays or their shapes)."""
  read, carry = [], None
  for block in blocks:
    read.append(tuple(sorted(reads(block, params, carry, batch))))
    carry = jax.eval_shape(block, params, carry, *batch)
  n = len(jax.tree.leaves(params))
  owner = [0] * n
  for k in reversed(range(len(blocks))):
    for i in read[k]:
      owner[i] = k
  segments = tuple(
      tuple(i for i in range(n) if owner[i] == k) for k in range(len(blocks))
  )
  return Plan(tuple(read), segments)


def unsegmentable(dp: Any, plan_: Plan) -> str | None:
  """Why ``dp``'s step cannot be split along ``plan_``, or None."""
  if plan_.num_exchanges < 2:
    return "its blocks' params complete in one segment"
  made_by = dp.compressor.made_by
  if made_by is not None and made_by[1].get("warm_start") is False:
    return (
        "without warm_start, its random factors are drawn for all leaves at"
        " once"
    )
  if dp.compressor.leaf_order is not None and made_by is None:
    return "its compressor has a leaf_order and no factory to drop it"
  if type(dp).__name__ == "ShardedDataParallel":
    return "ShardedDataParallel's state is sharded over the devices of a node"
  return None


def placed_like_inputs(fn: Callable, donate: tuple[int, ...], outputs: Callable):
  """``fn`` jitted with the arguments ``donate`` donated and its results
  placed where ``outputs(*args)`` says, for each placement of the arguments.

  Without the results' shardings, XLA pairs each donated buffer with the
  first result of its size: results then trade buffers through copies, and
  on XLA:CPU each call faults fresh pages for them (a segmented step's
  update took 0.2-0.7 s, against 0.04 s placed, in two processes). A
  low-rank phase marker is not donated: its shape changes with the phase,
  so no result could take its buffer and JAX would warn every step.
  """
  programs: dict[Any, Callable] = {}

  def call(*args):
    places = outputs(*args)
    leaves, treedef = jax.tree.flatten(args)
    owner = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    given = tuple(
        i in donate and not phase_lib.is_marker(x.dtype, x.shape)
        for i, x in zip(owner, leaves)
    )
    key = (treedef, given, jax.tree.structure(places))
    key += tuple(jax.tree.leaves(places))
    if key not in programs:

      def split(donated, kept):
        donated, kept = iter(donated), iter(kept)
        merged = [next(donated) if g else next(kept) for g in given]
        return fn(*treedef.unflatten(merged))

      programs[key] = jax.jit(split, donate_argnums=0, out_shardings=places)
    return programs[key](
        [x for x, g in zip(leaves, given) if g],
        [x for x, g in zip(leaves, given) if not g],
    )

  return call


def sharding_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.sharding, tree)


def fused_step(dp: Any, tx: optax.GradientTransformation, blocks) -> Callable:
  """The step of ``blocks`` in one jitted program; params and state donated
  and returned where they were given."""
  chained = dp.chain(tx)

  def loss_fn(params, *batch):
    carry = None
    for block in blocks:
      carry = block(params, carry, *batch)
    return carry

  def step(params, state, *batch):
    specs = (dp.device_spec,) * len(batch)
    loss, grads = dp.value_and_grad(loss_fn, batch_specs=specs)(
        params, *batch
    )
    updates, state = chained.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  replicated = jax.sharding.NamedSharding(dp.mesh, P())
  return placed_like_inputs(
      step,
      (0, 1),
      lambda params, state, *_: (*sharding_of((params, state)), replicated),
  )


class _Segmented:
  """The programs of one overlapped step, made for one plan."""

  def __init__(self, dp, tx, blocks, plan_: Plan, params: Any):
    self.dp, self.tx, self.blocks, self.plan = dp, tx, blocks, plan_
    self.treedef = jax.tree.structure(params)
    self.num_leaves = self.treedef.num_leaves
    # The exchanges in the order they are dispatched: last block first.
    self.order = [
        k for k in reversed(range(len(blocks))) if plan_.segments[k]
    ]
    compressor = dp.compressor
    if compressor.leaf_order is not None:
      compressor = compressor._replace(leaf_order=None)
    # Each segment runs with "propagate"; the update applies the policy
    # on non-finite means over all segments.
    self.segment_dp = type(dp)(
        compressor, dp.mesh, local_axis=dp.local_axis, nonfinite="propagate"
    )
    self.executor = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="acp_jax-comm"
    )
    self._residual_trees: dict[int, Any] = {}
    self._make_programs()

  # -- the programs ------------------------------------------------------------

  def _own_fn(self, k: int, leaves: list) -> Callable:
    """Block ``k`` as a function of the leaves it reads and its carry."""
    read = self.plan.reads[k]

    def f(own, carry, batch):
      full = list(leaves)
      for i, x in zip(read, own):
        full[i] = x
      return self.blocks[k](self.treedef.unflatten(full), carry, *batch)

    return f

  def _make_programs(self) -> None:
    dp, spec = self.dp, self.dp.device_spec
    stack = lambda tree: jax.tree.map(lambda x: x[None], tree)
    unstack = lambda tree: jax.tree.map(lambda x: x[0], tree)
    num_blocks = len(self.blocks)

    def forward(params, batch):
      leaves = jax.tree.leaves(params)
      inputs = {id(x): ("param", i) for i, x in enumerate(leaves)}
      batch_leaves = jax.tree.leaves(batch)
      inputs.update({id(x): ("batch", i) for i, x in enumerate(batch_leaves)})
      carry, kept, kept_ids, pullbacks = None, [], {}, []
      for k in range(num_blocks):
        own = [leaves[i] for i in self.plan.reads[k]]
        carry, vjp = jax.vjp(
            lambda o, c: self._own_fn(k, leaves)(o, c, batch), own, carry
        )
        res, tree = jax.tree.flatten(vjp)
        where = []
        for r in res:
          if id(r) in inputs:
            where.append(inputs[id(r)])
          else:
            if id(r) not in kept_ids:
              kept_ids[id(r)] = len(kept)
              kept.append(r)
            where.append(("kept", kept_ids[id(r)]))
        pullbacks.append((tree, where))
      self._pullbacks = pullbacks
      return stack(carry), stack(kept)

    self.forward = jax.jit(
        jax.shard_map(
            forward,
            mesh=dp.mesh,
            in_specs=(P(), spec),
            out_specs=(spec, spec),
            check_vma=False,
        )
    )
    self.backward = {}
    for k in self.order + [k for k in range(num_blocks) if k not in self.order]:
      self.backward[k] = self._backward_program(k, stack, unstack)
    self.exchange = {
        k: jax.jit(self._exchange_program(first=k == self.order[0]))
        for k in self.order
    }
    self.update = placed_like_inputs(
        self._update_program,
        (0, 1),
        lambda params, state, *_: sharding_of((params, state)),
    )

  def _backward_program(self, k: int, stack, unstack) -> Callable:
    """Block ``k``'s backward pass: from its output's cotangent and the
    partial gradients of the leaves it shares with later blocks, the
    gradients it completes, those it passes on, and its carry's cotangent."""
    dp, spec = self.dp, self.dp.device_spec
    read = self.plan.reads[k]
    last = k == len(self.blocks) - 1

    def backward(params, batch, kept, cotangent, pending):
      tree, where = self._pullbacks[k]
      leaves, batch_leaves = jax.tree.leaves(params), jax.tree.leaves(batch)
      kept, cotangent, pending = unstack((kept, cotangent, pending))
      sources = {"param": leaves, "batch": batch_leaves, "kept": kept}
      vjp = tree.unflatten([sources[kind][i] for kind, i in where])
      if last:
        cotangent = jnp.ones_like(cotangent)
      d_own, d_carry = vjp(cotangent)
      grads = {i: g for i, g in pending.items() if i not in read}
      for i, g in zip(read, d_own):
        grads[i] = g + pending[i] if i in pending else g
      # Block 0 completes the leaves no block reads: zeros, as fused.
      done = [
          grads.pop(i) if i in grads else jnp.zeros_like(leaves[i])
          for i in self.plan.segments[k]
      ]
      return stack((done, grads, d_carry))

    return jax.jit(
        jax.shard_map(
            backward,
            mesh=dp.mesh,
            in_specs=(P(), spec, spec, spec, spec),
            out_specs=spec,
            check_vma=False,
        )
    )

  def _exchange_program(self, first: bool) -> Callable:
    """A segment's exchange: its compressed mean and state; the first also
    averages the loss, so that no collective runs off the thread."""

    def exchange(grads, comm_state, loss):
      mean, state, finite = self.segment_dp._compress(grads, comm_state)
      return mean, state, finite, (jnp.mean(loss) if first else None)

    return exchange

  def _update_program(self, params, state, means, new_comm, finites):
    """``chain(tx)``'s update after the exchanges, on the merged mean and
    state."""
    mean = self._merge_leaves(means)
    new_comm = self._merge_state(new_comm, state.comm)
    finite = jnp.all(jnp.stack(finites))
    if self.dp.nonfinite != "propagate":
      new_comm = phase_lib.where(finite, new_comm, state.comm)
    updates, state = self.dp._inner_update(
        self.tx, mean, new_comm, finite, state, params, {}
    )
    return optax.apply_updates(params, updates), state

  # -- the state, by segment ---------------------------------------------------

  def _per_leaf(self, value: Any) -> list | None:
    """A state field's leaves, one per param (``MaskedNode`` at those it
    does not hold), or None for a field of the whole state."""
    if self.num_leaves < 2:
      return None
    try:
      return self.treedef.flatten_up_to(value)
    except (TypeError, ValueError):
      return None

  def split_state(self, comm: Any, k: int) -> Any:
    """Segment ``k``'s share of the compressor's state: each per-leaf field
    at its leaves, the other fields (phase, count) whole."""
    segment = self.plan.segments[k]
    fields = []
    for value in comm:
      leaves = self._per_leaf(value)
      fields.append(value if leaves is None else [leaves[i] for i in segment])
    return type(comm)(*fields)

  def _merge_leaves(self, parts: dict[int, list]) -> Any:
    full = [None] * self.num_leaves
    for k, values in parts.items():
      for i, x in zip(self.plan.segments[k], values):
        full[i] = x
    return self.treedef.unflatten(full)

  def _merge_state(self, parts: dict[int, Any], comm: Any) -> Any:
    fields = []
    for f, value in enumerate(comm):
      if self._per_leaf(value) is None:
        fields.append(parts[self.order[0]][f])
      else:
        fields.append(self._merge_leaves({k: s[f] for k, s in parts.items()}))
    return type(comm)(*fields)

  # -- one step ----------------------------------------------------------------

  def __call__(self, params, state, *batch):
    comm = state.comm
    loss, kept = self.forward(params, batch)
    cotangent, pending, futures = loss, {}, {}
    self.dispatched = []
    for k in reversed(range(len(self.blocks))):
      done, passed, cotangent = self.backward[k](
          params, batch, kept, cotangent, pending
      )
      pending = passed
      if self.plan.segments[k]:
        futures[k] = self.executor.submit(
            _on_stream, self.exchange[k], done, self.split_state(comm, k), loss
        )
        self.dispatched.append(k)
    results = {k: f.result() for k, f in futures.items()}
    means = {k: r[0] for k, r in results.items()}
    new_comm = {k: r[1] for k, r in results.items()}
    finites = [r[2] for r in results.values()]
    mean_loss = results[self.order[0]][3]
    params, state = self.update(params, state, means, new_comm, finites)
    return params, state, mean_loss


def _on_stream(program: Callable, *args: Any) -> Any:
  """``program(*args)`` dispatched on the communication stream."""
  with stream_context():
    return program(*args)


def make_step(
    dp: Any,
    tx: optax.GradientTransformation,
    blocks: Sequence[Callable],
    overlap: bool = False,
) -> Callable:
  """``DataParallel.step``'s step; see there."""
  blocks = tuple(blocks)
  if not blocks or not all(callable(b) for b in blocks):
    raise TypeError(
        "blocks must be a non-empty sequence of functions block(params,"
        f" carry, *batch), got {blocks!r}"
    )
  if not isinstance(overlap, bool):
    raise ValueError(f"overlap must be True or False, got {overlap!r}")
  fused = fused_step(dp, tx, blocks)
  if not overlap:
    return fused
  return OverlappedStep(dp, tx, blocks, fused)


class OverlappedStep:
  """``DataParallel.step(..., overlap=True)``: the segmented programs of
  each shape of the params and batch, made at its first call, or the fused
  step where the blocks cannot be split."""

  def __init__(self, dp, tx, blocks, fused: Callable):
    self.dp, self.tx, self.blocks, self.fused = dp, tx, blocks, fused
    self._cache: dict[Any, Callable] = {}
    self._last: Callable | None = None

  @property
  def exchange_order(self) -> tuple[int, ...]:
    """The blocks whose segments the last call exchanged, in dispatch order
    (the same on every process); () for the fused step."""
    return tuple(getattr(self._last, "dispatched", ()))

  def _programs(self, params, batch) -> Callable:
    key = (
        jax.tree.structure((params, batch)),
        tuple((x.shape, x.dtype) for x in jax.tree.leaves((params, batch))),
    )
    if key not in self._cache:
      n = self.dp.num_devices
      local = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(
              (x.shape[0] // n,) + x.shape[1:], x.dtype
          ),
          batch,
      )
      shapes = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
      )
      plan_ = plan(self.blocks, shapes, local)
      why = unsegmentable(self.dp, plan_)
      if why is None:
        self._cache[key] = _Segmented(
            self.dp, self.tx, self.blocks, plan_, shapes
        )
      else:
        _LOG.warning("acp_jax: the fused step, not the overlapped one: %s", why)
        self._cache[key] = self.fused
    return self._cache[key]

  def __call__(self, params, state, *batch):
    self._last = self._programs(params, batch)
    return self._last(params, state, *batch)
