"""Error feedback for element-wise compressors (Sign-SGD, Top-k).

Each device adds its residual to its gradient, sends a compressed form of the
sum and keeps what was not sent: p = g + e, e = p - sent. The mean of what
devices apply plus the mean residual then always equals the mean gradient
summed over steps, so nothing is lost, only delayed.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from acp_jax import _checks

# [p per leaf] -> ([what this device sent, decoded], [mean over devices]).
CompressFn = Callable[
    [list[jax.Array]], tuple[list[jax.Array], list[jax.Array]]
]


def zeros_like(params):
  """Zero residuals, one per leaf, in the leaf's dtype."""
  return jax.tree.map(jnp.zeros_like, params)


def apply(grads, errors, compress: CompressFn, caller: str):
  """Returns (mean update tree, new residual tree)."""
  _checks.check_tree_matches(grads, errors, caller)
  leaves, treedef = jax.tree.flatten(grads)
  ps = [g + e for g, e in zip(leaves, jax.tree.leaves(errors))]
  # A zero-size leaf passes through: ``compress`` never sees one (top_k
  # cannot pick from it, and the mean magnitude of nothing is NaN).
  sized = [i for i, p in enumerate(ps) if p.size]
  sent, mean = list(ps), list(ps)
  for i, s, m in zip(sized, *compress([ps[i] for i in sized])):
    sent[i], mean[i] = s, m
  new_errors = [p - s for p, s in zip(ps, sent)]
  return (
      jax.tree.unflatten(treedef, mean),
      jax.tree.unflatten(treedef, new_errors),
  )
