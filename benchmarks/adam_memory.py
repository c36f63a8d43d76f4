"""Adam's state beside a low-rank compressor: AdamW's moments, which are the
params' size twice, against ``acp_jax.subspace_adam``'s, kept in the
coordinates the compressor all-reduces. Read from abstract states (nothing
is allocated), so BERT-Base costs no memory.
"""

from typing import Any

import jax
import optax

import acp_jax
from acp_jax import collectives
from benchmarks import workloads

METHODS = ("power_sgd", "acp_sgd")


def _nbytes(tree: Any) -> int:
  return sum(
      collectives.nbytes(x.shape, x.dtype) for x in jax.tree.leaves(tree)
  )


def measure(model: str) -> list[dict[str, Any]]:
  """Per low-rank method of ``model``'s config (its rank), the bytes of
  AdamW's moments and of ``subspace_adam``'s (its bases included), and of
  the compressor's own state (the residuals, per device, and the factors),
  which both keep."""
  params = workloads.experiment(model).abstract_params
  adamw = jax.eval_shape(optax.scale_by_adam().init, params)
  rows = []
  for method in METHODS:
    compressor = workloads.compressor(model, method)
    own = jax.eval_shape(compressor.init, params)
    state = jax.eval_shape(acp_jax.subspace_adam(compressor).init, params)
    subspace = (state.dense.mu, state.dense.nu, state.on_p, state.on_q)
    rows.append(
        {
            "model": model,
            "method": method,
            "rank": compressor.made_by[1]["rank"],
            "params_bytes": _nbytes(params),
            "adamw_moments_bytes": _nbytes((adamw.mu, adamw.nu)),
            "subspace_moments_bytes": _nbytes(subspace),
            "compressor_bytes": _nbytes(own),
        }
    )
  return rows
