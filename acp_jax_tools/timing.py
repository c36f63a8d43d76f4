"""Wall time of a compressor's update on one device, as the advice and the
benchmarks measure it.

The update runs under ``shard_map`` over a one-device mesh, so its
collectives move nothing and the time is the compressor's own arithmetic
(residuals, projections, orthogonalization, selection, packing).
"""

import time
from typing import Any

import jax
import numpy as np

from acp_jax import compressor as compressor_lib
from acp_jax import data_parallel
from acp_jax import overlap


def interleaved(calls: dict[Any, Any], repeats: int, warmup: int = 2):
  """Seconds of each zero-argument call, ``repeats`` times each.

  The calls take turns, so a slow spell of a shared machine hits all of
  them alike and their ratios stay fair.
  """
  for _ in range(warmup):
    for call in calls.values():
      jax.block_until_ready(call())
  times = {key: [] for key in calls}
  for _ in range(repeats):
    for key, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[key].append(time.perf_counter() - start)
  return times


def phase_calls(tx, params: Any, seed: int = 0) -> list[Any]:
  """One zero-argument call per phase of ``tx``: its update on one device,
  on random normal gradients shaped like ``params``.

  The calls must run in phase order: each takes the state the previous one
  left (donated, as in a train step, so the residuals are updated in place;
  ``overlap.placed_like_inputs``).
  """
  mesh = jax.make_mesh(
      (1,),
      (tx.axis_name,),
      devices=jax.local_devices()[:1],
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  dp = data_parallel.DataParallel(tx, mesh)
  rng = np.random.default_rng(seed)
  grads = jax.tree.map(
      lambda x, g: jax.device_put(
          rng.standard_normal(g.shape, np.float32).astype(g.dtype), g.sharding
      ),
      params,
      dp.abstract_local_grads(params),
  )
  compress = overlap.placed_like_inputs(
      dp.compress, (1,), lambda *args: overlap.sharding_of(args)
  )
  state = [dp.init_comm(params)]

  def call():
    updates, state[0] = compress(grads, state[0])
    return updates

  return [call] * len(compressor_lib.comm_bytes(tx, params, num_devices=1))
