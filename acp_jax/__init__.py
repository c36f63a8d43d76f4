"""acp_jax: communication-efficient data-parallel training as optax transforms.

Each factory returns an ``optax.GradientTransformation`` whose update, called
inside ``jax.shard_map`` or ``jax.pmap`` with a device's local gradients,
returns their (approximate) mean over the data-parallel axis.

The measurement tools (the advice, the cost model, simulated devices,
timing, the readers of compiled HLO) live in ``acp_jax_tools``, which
``import acp_jax`` does not load: ``acp_jax.advise``, ``acp_jax.Advice``,
``acp_jax.advice`` and ``acp_jax.hlo`` import theirs on first use.
"""

import importlib
from typing import Any

from acp_jax._checks import PlacementWarning
from acp_jax.acp import acp_sgd
from acp_jax.acp import AcpSgdState
from acp_jax.buckets import backward_order
from acp_jax.compressor import chain
from acp_jax.compressor import comm_bytes
from acp_jax.compressor import CommVolume
from acp_jax.compressor import Compressor
from acp_jax.data_parallel import DataParallel
from acp_jax.data_parallel import DataParallelState
from acp_jax.data_parallel import LocalGrads
from acp_jax.lapack import limit_lapack_threads
from acp_jax.lowrank import Options as LowRankOptions
from acp_jax.phase import Phase
from acp_jax.powersgd import power_sgd
from acp_jax.sharded import memory_per_device
from acp_jax.sharded import MemoryPerDevice
from acp_jax.sharded import ShardedDataParallel
from acp_jax.powersgd import PowerSgdState
from acp_jax import registry  # pylint: disable=unused-import
from acp_jax.sign import sign_sgd
from acp_jax.sign import SignSgdState
from acp_jax.ssgd import ssgd
from acp_jax.topk import topk_sgd
from acp_jax.topk import TopkSgdState

__version__ = "0.2.0"

__all__ = (
    "AcpSgdState",
    "Advice",
    "CommVolume",
    "Compressor",
    "DataParallel",
    "DataParallelState",
    "LocalGrads",
    "LowRankOptions",
    "MemoryPerDevice",
    "Phase",
    "PlacementWarning",
    "PowerSgdState",
    "ShardedDataParallel",
    "SignSgdState",
    "TopkSgdState",
    "acp_sgd",
    "advise",
    "backward_order",
    "chain",
    "comm_bytes",
    "limit_lapack_threads",
    "memory_per_device",
    "power_sgd",
    "sign_sgd",
    "ssgd",
    "topk_sgd",
)

# The tools' public names, each as (module, attribute; None: the module).
_TOOLS = {
    "Advice": ("acp_jax_tools.advice", "Advice"),
    "advice": ("acp_jax_tools.advice", None),
    "advise": ("acp_jax_tools.advice", "advise"),
    "hlo": ("acp_jax_tools.hlo", None),
}


def __getattr__(name: str) -> Any:
  """A tool's public name, imported from ``acp_jax_tools`` on first use."""
  if name not in _TOOLS:
    raise AttributeError(f"module 'acp_jax' has no attribute {name!r}")
  module, attribute = _TOOLS[name]
  value = importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  """The package's names, the tools' not yet imported among them."""
  return sorted(set(globals()) | set(_TOOLS))
