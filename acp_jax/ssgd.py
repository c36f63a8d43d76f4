"""S-SGD: the dense all-reduce every compressor is measured against."""

import jax
import optax

from acp_jax import _checks
from acp_jax import buckets
from acp_jax import collectives
from acp_jax import compressor
from acp_jax import phase as phase_lib


def ssgd(
    *,
    axis_name: str = "data",
    comm_dtype=None,
    bucket_bytes: float | None = None,
    leaf_order=None,
) -> compressor.Compressor:
  """S-SGD: the mean gradient over the axis by a dense all-reduce.

  ``update = allreduce_sum(G / N)``, sent in ``comm_dtype`` if given (each
  device divides by N first, so fp16 sums do not overflow), in buckets in
  backward order as in PyTorch DDP, and returned in the gradient's dtype.

  Args:
    axis_name: the mapped axis over which devices hold their data shards.
    comm_dtype: floating dtype to communicate in (e.g. ``jnp.bfloat16``), or
      ``None`` for the gradients' own dtype.
    bucket_bytes: gradient bytes (in the gradients' dtype) per bucket; None
      for 25 MiB (PyTorch DDP's default), ``math.inf`` for one all-reduce
      per dtype.
    leaf_order: the leaves in backward order, from
      ``acp_jax.backward_order``; None for the reverse of the leaf order.

  Returns:
    A stateless ``Compressor``; its update runs inside ``jax.shard_map`` or
    ``jax.pmap`` over ``axis_name``.

  Example::

    tx = acp_jax.chain(acp_jax.ssgd(comm_dtype=jnp.bfloat16), optax.sgd(0.1))
  """
  args = _checks.bucketed_args(
      "ssgd", axis_name, bucket_bytes, leaf_order, comm_dtype=comm_dtype
  )

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state):
    leaves, treedef = jax.tree.flatten(updates)
    mean = collectives.bucketed_pmean(
        leaves,
        buckets.leaf_plan(leaves, args.bucket_bytes, args.leaf_order),
        axis_name,
        comm_dtype,
    )
    return jax.tree.unflatten(treedef, mean), state

  def volume(params, num_devices):
    del num_devices
    step = collectives.dense_nbytes(params, comm_dtype)
    return {phase_lib.STEP: compressor.CommVolume(all_reduce=step)}

  return compressor.from_parts(
      args, optax.EmptyState, init, update, volume, local_fields=()
  )
