"""State trees that mirror the params, with ``optax.MaskedNode`` where a
param keeps no state (a leaf sent dense, or every leaf without error
feedback)."""

from typing import Any

import jax
import optax


def is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def state_leaves(state_tree: Any) -> list[Any]:
  """Leaves of a state tree that mirrors the params, one per param: an array,
  or ``optax.MaskedNode`` where that param keeps no state."""
  return jax.tree.leaves(state_tree, is_leaf=is_masked)
