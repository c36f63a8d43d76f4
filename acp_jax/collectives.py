"""Collectives over a named mapped axis, in buckets of gradient leaves.

Every compressor exchanges its leaves in buckets, as PyTorch DDP does: taken
in backward order (``leaf_order``; without one, the reverse of the leaf
order, a proxy that a tied embedding defeats) and cut into consecutive
buckets of at most ``bucket_bytes`` of *uncompressed* gradient
(``acp_jax.buckets``). So a compressor's buckets are S-SGD's, each sending
its compressed share: for the low-rank factors, the paper's 25 MB fusion
buffer scaled by the compression ratio, and one plan for ACP-SGD's P-steps
and Q-steps.

An all-reduce round sends each array of a bucket by its own all-reduce, not
packed into one buffer: packing copies every byte sent (on one CPU device
ResNet-50's S-SGD update took 153 ms packed against 23 ms) and makes each
bucket wait for its last leaf. XLA merges independent all-reduces (XLA:GPU
up to ``--xla_gpu_all_reduce_combine_threshold_bytes``; XLA:CPU's
``cpu-all-reduce-combiner`` all of them, losing no overlap, as XLA:CPU
overlaps none). A method whose second round needs its first one's result
(Power-SGD) packs each bucket's round instead (``packed``): the combiner
would merge one leaf's Q with another's P and chain the rounds (a small
ResNet in 13 buckets: 11 all-reduces in 11 rounds; 23 in 2 with the
combiner off; 2 in 2 with one bucket per round). Buckets buy such a method
nothing on XLA:CPU, so it sends one bucket per round there
(``buckets.for_packed_rounds``);
``--xla_disable_hlo_passes=cpu-all-reduce-combiner`` shows the all-reduces
one by one. All-gathers (Sign-SGD's, Top-k's) are packed per bucket and
dtype; XLA:CPU does not combine them.

Across processes, XLA:CPU's collectives (gloo) send each operand of a tuple
all-reduce as a message of its own, with its ring's latency: a round of small
factors is bound by their number, not their bytes, so ACP-SGD packs its
round there, in one bucket (``network_sends_each_operand``). S-SGD's leaves
stay apart, their bytes dwarfing the messages' latency.

``split_over``: in hierarchical data parallelism every buffer is identical
on the L devices of a node, and every round is packed. Sent whole, each
buffer would cross the slow network L times; instead device ``i`` runs the
collective over the node axis on chunk ``i`` of it (zero-padded to a
multiple of L), and a tiled all-gather over ``local_axis`` reassembles the
unsplit collective's result.

``row_shards``: in sharded data parallelism each device of a node holds its
own block of rows of every leaf, so its buffers differ and are sent whole.
Sums over a matrix's rows (``row_sum``: M^T P, a Gram matrix) are identical
on the node's devices once summed over that axis; those sent across nodes
are split over it (``bucketed_psum``'s ``row_sums``).

``recording`` lists the collectives that buffers go through while a function
is traced, by axis: the exact bytes per device of a step.
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import contextvars
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from acp_jax import _dataflow

# Leaf indices, bucket by bucket, in the order the buckets are sent.
BucketPlan = Sequence[Sequence[int]]

# Set by the runtime around a compressor's update, whose signature optax
# fixes: context variables carry the exchange's layout. Each is read only
# while a step is traced and defaults to the plain data-parallel exchange.

# The axis over which packed buffers are split, or None (see ``split_over``).
_SPLIT_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "split_axis", default=None
)
# The axis over which leaves' rows are sharded, its size and the whole
# leaves' unpadded rows, or None (see ``row_shards``).
_ROW_AXIS: contextvars.ContextVar[tuple[str, int, Any] | None] = (
    contextvars.ContextVar("row_axis", default=None)
)
# Where the collectives of packed buffers are listed (see ``recording``).
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "record", default=None
)
# Whether recorded collectives are traced as calls of ``_send``, for
# ``recorded_unless_folded`` to find them in the jaxpr.
_MARK_SENDS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mark_sends", default=False
)
# Where the buffers the collectives return are kept (see ``receiving``).
_RECEIVED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "received", default=None
)


class Sent(NamedTuple):
  """A collective that a packed buffer (or a chunk of it) went through.

  Attributes:
    kind: ``"all_reduce"`` or ``"all_gather"``.
    axis_name, axis_size: the mapped axis it runs over, and its size.
    size, dtype: the elements each device contributes, and their dtype.
  """

  kind: str
  axis_name: str
  axis_size: int
  size: int
  dtype: jnp.dtype

  @property
  def nbytes(self) -> int:
    """Result bytes per device: the buffer of an all-reduce, everything an
    all-gather gathers (the axis size times the contribution)."""
    n = self.axis_size if self.kind == "all_gather" else 1
    return n * nbytes((self.size,), self.dtype)


@contextlib.contextmanager
def split_over(axis_name: str | None) -> Iterator[None]:
  """Within it, packed buffers are sent in chunks, one per device of
  ``axis_name``, and reassembled over it: only for buffers identical on
  every device of ``axis_name``. ``None`` sends buffers whole.

  Args:
    axis_name: a mapped axis other than the collectives' own, or None.
  """
  token = _SPLIT_AXIS.set(axis_name)
  try:
    yield
  finally:
    _SPLIT_AXIS.reset(token)


@contextlib.contextmanager
def row_shards(
    axis_name: str, parts: int, rows: Sequence[int] | None = None
) -> Iterator[None]:
  """Within it, every leaf a compressor is handed is one device's block of
  rows, its leading axis sharded over ``axis_name``. Matrix views are
  decided on the whole leaf (``global_shape``); sums over rows go through
  ``row_sum``, and buffers marked ``row_sums`` are split over the axis.

  Args:
    axis_name: a mapped axis other than the collectives' own.
    parts: its size.
    rows: the rows of each whole leaf before it was zero-padded to
      ``parts`` blocks, in leaf order (``leaf_size``, ``real_rows``); None
      where nothing is padded.
  """
  token = _ROW_AXIS.set(
      (axis_name, parts, None if rows is None else tuple(rows))
  )
  try:
    yield
  finally:
    _ROW_AXIS.reset(token)


def row_axis() -> tuple[str, int] | None:
  """The axis name and size of ``row_shards``, or None outside it."""
  rows = _ROW_AXIS.get()
  return None if rows is None else rows[:2]


def global_shape(shape: Sequence[int]) -> tuple[int, ...]:
  """The whole leaf's shape for a block of ``shape`` within ``row_shards``."""
  rows = _ROW_AXIS.get()
  if rows is None or not shape:
    return tuple(shape)
  return (shape[0] * rows[1],) + tuple(shape[1:])


def row_sum(x: jax.Array) -> jax.Array:
  """``x`` summed over the axis of ``row_shards`` (listed where
  ``recording``); ``x`` itself outside it."""
  rows = _ROW_AXIS.get()
  if rows is None:
    return x
  return all_reduce(x, rows[0])


def row_gather(x: jax.Array) -> jax.Array:
  """Every device's ``x`` over the axis of ``row_shards``, stacked on a new
  leading axis (listed where ``recording``); ``x[None]`` outside it."""
  rows = _ROW_AXIS.get()
  if rows is None:
    return x[None]
  return _collective("all_gather", x, rows[0])


def leaf_size(block: jax.Array, index: int) -> int:
  """Elements of leaf ``index`` of the update, whose block is ``block``,
  before any padding: ``block.size`` outside ``row_shards``."""
  rows = _ROW_AXIS.get()
  if rows is None:
    return block.size
  whole = global_shape(block.shape)
  real = whole[0] if rows[2] is None or not whole else rows[2][index]
  return real * math.prod(whole[1:])


def real_rows(block: jax.Array, index: int) -> jax.Array:
  """``block`` with the rows that pad leaf ``index`` set to zero (see
  ``row_shards``); ``block`` itself where nothing is padded."""
  rows = _ROW_AXIS.get()
  if rows is None or rows[2] is None or not block.shape:
    return block
  start = lax.axis_index(rows[0]) * block.shape[0]
  row = start + lax.broadcasted_iota(jnp.int32, block.shape, 0)
  return jnp.where(row < rows[2][index], block, jnp.zeros_like(block))


def leaf_mean(
    block_sum: jax.Array, block: jax.Array, index: int
) -> jax.Array:
  """The mean of leaf ``index``'s elements, from the sum of this device's
  ``block``; within ``row_shards``, over the unpadded whole leaf. Padding
  rows must be zero."""
  return row_sum(block_sum) / leaf_size(block, index)


def network_sends_each_operand() -> bool:
  """Whether an all-reduce of several arrays crosses the network as one
  message per array: on XLA:CPU across processes."""
  return jax.default_backend() == "cpu" and jax.process_count() > 1


def all_reduce(x: jax.Array, axis_name: str) -> jax.Array:
  """``lax.psum(x, axis_name)``, listed where ``recording``."""
  return _collective("all_reduce", x, axis_name)


@contextlib.contextmanager
def recording() -> Iterator[list[Sent]]:
  """Lists every collective of a bucket's buffers traced within it.

  Example::

    with collectives.recording() as sent:
      jax.eval_shape(step, *abstract_args)
    total = sum(s.nbytes for s in sent if s.axis_name == "data")

  Yields:
    The list that the ``Sent`` records are appended to, in tracing order.
  """
  with _listing(_RECORD) as sent:
    yield sent


def recorded_unless_folded(fun: Callable[..., Any], *args: Any) -> list[Sent]:
  """What ``recording`` lists of ``fun(*args)``, less the collectives that
  XLA folds away, of values computed from constants only (the zero gradient
  of a param the loss never reads), told by ``fun``'s jaxpr."""
  token = _MARK_SENDS.set(True)
  try:
    with recording() as sent:
      jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
  finally:
    _MARK_SENDS.reset(token)
  sends_inputs = _dataflow.flow(
      jaxpr,
      [True] * len(jaxpr.invars),
      opaque=True,
      mark=_lax_collective.__name__,
  )[1]
  return [s for s, kept in zip(sent, sends_inputs, strict=True) if kept]


@contextlib.contextmanager
def receiving() -> Iterator[list[jax.Array]]:
  """Lists, within it, the whole buffer that each collective of these
  helpers returns (reassembled, when split; the same on every device), in
  tracing order."""
  with _listing(_RECEIVED) as received:
    yield received


@contextlib.contextmanager
def _listing(var: contextvars.ContextVar) -> Iterator[list]:
  listed = []
  token = var.set(listed)
  try:
    yield listed
  finally:
    var.reset(token)


def axis_size(axis_name: str, caller: str) -> int:
  """Size of the mapped axis ``axis_name``; a clear error if it is unbound."""
  try:
    return lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not bound. Call the update"
        " inside a mapped step over that axis, e.g."
        f" jax.shard_map(step, mesh=jax.make_mesh((n,), ({axis_name!r},)),"
        f" ...) or jax.pmap(step, axis_name={axis_name!r})."
    ) from None


def _collective(
    kind: str, x: jax.Array, axis_name: str, axis: int = 0, tiled: bool = False
) -> jax.Array:
  """``lax.psum`` or ``lax.all_gather`` of ``x``, listed where ``recording``."""
  record = _RECORD.get()
  if record is None:
    return _lax_collective(x, kind, axis_name, axis, tiled)
  record.append(
      Sent(kind, axis_name, axis_size(axis_name, kind), x.size, x.dtype)
  )
  if _MARK_SENDS.get():
    return jax.jit(_lax_collective, static_argnums=(1, 2, 3, 4))(
        x, kind, axis_name, axis, tiled
    )
  return _lax_collective(x, kind, axis_name, axis, tiled)


def _lax_collective(
    x: jax.Array, kind: str, axis_name: str, axis: int, tiled: bool
) -> jax.Array:
  if kind == "all_reduce":
    return lax.psum(x, axis_name)
  return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def _split_axis(row_sums: bool) -> str | None:
  """The axis a buffer is split over: ``split_over``'s, or for a buffer of
  ``row_sums`` the axis of ``row_shards``."""
  rows = _ROW_AXIS.get()
  if row_sums and rows is not None:
    return rows[0]
  return _SPLIT_AXIS.get()


def _send(
    kind: str, flat: jax.Array, axis_name: str, local: str | None
) -> jax.Array:
  """The ``kind`` collective of a flat buffer, in chunks over the axis
  ``local`` if not None."""
  if local == axis_name:
    raise ValueError(
        f"split_over: axis_name={local!r} is the collectives' own axis; a"
        " buffer is split over a second axis, over which it is identical"
    )
  parts = 1 if local is None else axis_size(local, "split_over")
  if parts == 1:
    return _collective(kind, flat, axis_name)
  chunk = -(-flat.size // parts)
  padded = jnp.pad(flat, (0, chunk * parts - flat.size))
  mine = lax.dynamic_slice_in_dim(padded, lax.axis_index(local) * chunk, chunk)
  done = _collective(kind, mine, axis_name)
  # The chunks in order along the buffer's own (last) axis, after the node
  # axis that an all-gather prepends.
  whole = _collective("all_gather", done, local, axis=done.ndim - 1, tiled=True)
  return whole[..., : flat.size]


def _packed(
    kind: str,
    arrays: Sequence[jax.Array],
    axis_name: str,
    local: str | None = None,
) -> list[jax.Array]:
  """The ``kind`` collective of one flat buffer per dtype, split back into
  arrays (an all-gather prepends the axis size); an empty one is not sent."""
  lead = () if kind == "all_reduce" else (axis_size(axis_name, kind),)
  by_dtype: dict[jnp.dtype, list[int]] = {}
  for i, x in enumerate(arrays):
    by_dtype.setdefault(x.dtype, []).append(i)
  out = [None] * len(arrays)
  for dtype, members in by_dtype.items():
    flat = jnp.concatenate([arrays[i].ravel() for i in members])
    flat = (
        _send(kind, flat, axis_name, local)
        if flat.size
        else jnp.zeros(lead + flat.shape, dtype)
    )
    received = _RECEIVED.get()
    if received is not None:
      received.append(flat)
    start = 0
    for i in members:
      x = arrays[i]
      out[i] = flat[..., start : start + x.size].reshape(lead + x.shape)
      start += x.size
  return out


def _each(arrays: Sequence[jax.Array], axis_name: str) -> list[jax.Array]:
  """``lax.psum`` of the arrays together, one all-reduce per non-empty
  array, copied into no buffer."""
  sent = [x for x in arrays if x.size]
  record = _RECORD.get()
  if record is not None and _MARK_SENDS.get():
    summed = [_collective("all_reduce", x, axis_name) for x in sent]
  else:
    if record is not None:
      n = axis_size(axis_name, "all_reduce")
      record.extend(
          Sent("all_reduce", axis_name, n, x.size, x.dtype) for x in sent
      )
    summed = lax.psum(tuple(sent), axis_name)
  received = _RECEIVED.get()
  if received is not None:
    received.extend(summed)
  summed = iter(summed)
  return [next(summed) if x.size else x for x in arrays]


def _bucketed(
    kind: str,
    per_leaf: Sequence[Sequence[jax.Array]],
    plan: BucketPlan,
    axis_name: str,
    packed: bool = True,
    row_sums: Sequence[bool | Sequence[bool]] | None = None,
) -> list[list[jax.Array]]:
  """The ``kind`` collective of each bucket's arrays (``_packed``, or
  ``_each`` for an all-reduce not ``packed``, split or within
  ``row_shards``); ``per_leaf[i]`` are the arrays leaf ``i`` sends. Within
  ``row_shards``, arrays marked in ``row_sums`` and the others go as two
  groups, each split its own way."""
  flags = [(False,) * len(arrays) for arrays in per_leaf]
  if row_sums is not None and _ROW_AXIS.get() is not None:
    flags = [
        tuple(m) if isinstance(m, Sequence) else (bool(m),) * len(arrays)
        for arrays, m in zip(per_leaf, row_sums)
    ]
  out = [[None] * len(arrays) for arrays in per_leaf]
  for bucket in plan:
    for group in (False, True):
      places = [
          (i, j) for i in bucket for j, f in enumerate(flags[i]) if f == group
      ]
      if not places:
        continue
      arrays = [per_leaf[i][j] for i, j in places]
      local = _split_axis(group)
      # Within row_shards every buffer is packed, as split buffers are: a
      # tuple all-reduce across nodes is one message per array on XLA:CPU.
      if kind == "all_reduce" and not (packed or local or _ROW_AXIS.get()):
        done = _each(arrays, axis_name)
      else:
        done = _packed(kind, arrays, axis_name, local)
      for (i, j), x in zip(places, done):
        out[i][j] = x
  return out


def bucketed_psum(
    per_leaf: Sequence[Sequence[jax.Array]],
    plan: BucketPlan,
    axis_name: str,
    *,
    packed: bool = False,
    row_sums: Sequence[bool | Sequence[bool]] | None = None,
) -> list[list[jax.Array]]:
  """``lax.psum`` of every array, bucket by bucket: one all-reduce per
  array, or with ``packed`` (or within ``split_over``) one per bucket and
  dtype, of a buffer that the arrays are copied into.

  Args:
    per_leaf: for each leaf, the arrays it sends (none, one, or several).
    plan: the buckets, from ``buckets.bucket_plan`` over the same leaves.
    axis_name: the mapped axis to sum over.
    packed: pack each bucket into one buffer per dtype.
    row_sums: None, or for each leaf whether its arrays are sums over rows
      (``row_sum``), one flag or one per array: within ``row_shards``, they
      are split over its axis.

  Returns:
    The summed arrays, nested like ``per_leaf``.
  """
  return _bucketed("all_reduce", per_leaf, plan, axis_name, packed, row_sums)


def bucketed_all_gather(
    per_leaf: Sequence[Sequence[jax.Array]],
    plan: BucketPlan,
    axis_name: str,
    *,
    row_sums: Sequence[bool | Sequence[bool]] | None = None,
) -> list[list[jax.Array]]:
  """``lax.all_gather`` of every array, one all-gather per bucket and dtype.

  Like ``bucketed_psum``; each result has a new leading axis whose entry
  ``j`` holds device ``j``'s array. ``row_sums`` marks the arrays identical
  over the axis of ``row_shards``, split over it.
  """
  axis_size(axis_name, "bucketed_all_gather")
  return _bucketed("all_gather", per_leaf, plan, axis_name, row_sums=row_sums)


def bucketed_pmean(
    leaves: Sequence[jax.Array],
    plan: BucketPlan,
    axis_name: str,
    comm_dtype=None,
) -> list[jax.Array]:
  """The mean of every array over the axis, one all-reduce per array, bucket
  by bucket: S-SGD's exchange.

  Each device divides by the axis size before the sum, so that low-precision
  sums do not overflow, and sends in ``comm_dtype`` (None: each array's own).
  """
  n = axis_size(axis_name, "bucketed_pmean")
  sent = [[(x / n).astype(comm_dtype or x.dtype)] for x in leaves]
  summed = bucketed_psum(sent, plan, axis_name)
  return [s.astype(x.dtype) for (s,), x in zip(summed, leaves)]


def nbytes(shape: Sequence[int], dtype) -> int:
  """Bytes of an array of this shape and dtype."""
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def dense_nbytes(tree: Any, dtype: Any = None) -> int:
  """Bytes of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``),
  in ``dtype`` if given, else in its own: what one dense all-reduce of it
  sends per device."""
  return sum(nbytes(x.shape, dtype or x.dtype) for x in jax.tree.leaves(tree))
