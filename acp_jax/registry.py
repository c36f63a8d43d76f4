"""The compressors by name: each factory and what the project knows of it.

The package, ``ShardedDataParallel``, the trainer's configs, the benchmarks
and unpickling (``Compressor.made_by``) read this table: a compressor added
with ``register`` is one that all of them take.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

from acp_jax import compressor as compressor_lib
from acp_jax.acp import AcpSgdState
from acp_jax.acp import acp_sgd
from acp_jax.powersgd import PowerSgdState
from acp_jax.powersgd import power_sgd
from acp_jax.sign import SignSgdState
from acp_jax.sign import sign_sgd
from acp_jax.ssgd import ssgd
from acp_jax.topk import TopkSgdState
from acp_jax.topk import topk_sgd


@dataclasses.dataclass(frozen=True)
class Entry:
  """A compressor's factory and its facts.

  Attributes:
    name: the factory's name, as ``made_by`` records it and a config names
      it (``--config.compressor.name``).
    factory: ``(**arguments) -> Compressor``, taking ``axis_name``.
    label: how tables and plots name it.
    color: its colour in plots.
    config: its factory's arguments in a training config, each settable
      from the command line; a type stands for None (the factory's
      default) of that type, so that an override parses. Readers copy it.
    low_rank: whether it has a ``rank`` and a dense warm-up
      (``warmup_steps``), as Power-SGD and ACP-SGD do.
    rounds: the dependent all-reduce rounds of one step
      (``acp_jax_tools.hlo.collective_rounds`` of its compiled update): 2
      for Power-SGD, whose second projection needs the first's all-reduced
      factor. The cost model fuses its all-reduces into that many.
    pipelined: whether its one all-reduce a step can overlap backprop, each
      leaf's needing only that leaf's gradient (and, for ACP-SGD, a factor
      of the step before); the cost model then hides it behind backward.
    row_sharded: whether ``ShardedDataParallel`` can run it on blocks of
      rows: it sums over a leaf only through ``collectives.leaf_mean`` and
      selects through ``collectives.row_gather``.
    state: the type of its state (a NamedTuple), or None for one that holds
      nothing only it can continue; a checkpoint of such a state records the
      compressor and its arguments, and a restore refuses another.
  """

  name: str
  factory: Callable[..., compressor_lib.Compressor]
  label: str = ""
  color: str = ""
  config: dict[str, Any] = dataclasses.field(default_factory=dict)
  low_rank: bool = False
  rounds: int = 1
  pipelined: bool = False
  row_sharded: bool = False
  state: type | None = None


_ENTRIES: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
  """Adds ``entry``; raises if its name is taken."""
  if entry.name in _ENTRIES:
    raise ValueError(f"a compressor named {entry.name!r} is registered")
  _ENTRIES[entry.name] = entry
  compressor_lib.FACTORIES[entry.name] = entry.factory
  return entry


def unregister(name: str) -> None:
  """Removes the compressor ``name`` (a test's own, once it is done)."""
  get(name)
  del _ENTRIES[name]
  del compressor_lib.FACTORIES[name]


def state_types() -> tuple[type, ...]:
  """The registered compressors' state types."""
  return tuple(e.state for e in _ENTRIES.values() if e.state is not None)


def names() -> tuple[str, ...]:
  """The compressors' names, in the order they were registered."""
  return tuple(_ENTRIES)


def low_rank() -> tuple[str, ...]:
  """The low-rank compressors' names, in the order they were registered."""
  return tuple(name for name, e in _ENTRIES.items() if e.low_rank)


def get(name: str) -> Entry:
  """The entry of compressor ``name``; raises naming the registered ones."""
  if name not in _ENTRIES:
    raise ValueError(
        f"no compressor named {name!r}; registered: {', '.join(_ENTRIES)}"
    )
  return _ENTRIES[name]


def make(name: str, args: dict[str, Any]) -> compressor_lib.Compressor:
  """The compressor that ``made_by == (name, args)`` records."""
  return get(name).factory(**args)


# Every argument but keep_dense (a tree or a function) and leaf_order (the
# trainer reads it from the model's loss). comm_dtype None: the gradients';
# bucket_bytes None: 25 MiB, PyTorch DDP's.
_LOW_RANK_CONFIG = {
    "rank": 4,
    "min_compression_rate": 2.0,
    "use_error_feedback": True,
    "warm_start": True,
    "comm_dtype": str,
    "warmup_steps": 0,  # dense S-SGD steps first (configs' dense_warmup)
    "warmup_factors": True,
    "seed": 0,  # the initial factors (the same on every replica)
    "bucket_bytes": float,
}

register(
    Entry(
        "ssgd",
        ssgd,
        "S-SGD",
        "#4c4c4c",
        {"comm_dtype": str, "bucket_bytes": float},
        pipelined=True,
        row_sharded=True,
    )
)
register(
    Entry(
        "sign_sgd",
        sign_sgd,
        "Sign-SGD",
        "#e69f00",
        {"majority_vote": False, "bucket_bytes": float},
        row_sharded=True,
        state=SignSgdState,
    )
)
register(
    Entry(
        "topk_sgd",
        topk_sgd,
        "Top-k",
        "#56b4e9",
        {"density": 0.01, "bucket_bytes": float},
        row_sharded=True,
        state=TopkSgdState,
    )
)
register(
    Entry(
        "power_sgd",
        power_sgd,
        "Power-SGD",
        "#009e73",
        _LOW_RANK_CONFIG,
        low_rank=True,
        rounds=2,
        row_sharded=True,
        state=PowerSgdState,
    )
)
register(
    Entry(
        "acp_sgd",
        acp_sgd,
        "ACP-SGD",
        "#d55e00",
        _LOW_RANK_CONFIG,
        low_rank=True,
        pipelined=True,
        row_sharded=True,
        state=AcpSgdState,
    )
)
