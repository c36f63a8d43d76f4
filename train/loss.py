"""The training loss: softmax cross-entropy of integer targets, weighted.

One definition for the train and eval steps and for the benchmarks that
time or differentiate the same loss.
"""

import jax
import jax.numpy as jnp
import optax


def weighted_sums(
    logits: jax.Array, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums of the loss, correct predictions and weight over a batch.

  Args:
    logits: ``[..., classes]``, any floating dtype; the loss is taken in
      float32 (or wider).
    batch: ``"targets"``, integer ``[...]``, and optionally ``"weights"``,
      ``[...]`` (padding rows and unpredicted positions weigh 0; all ones
      without it).

  Returns:
    ``(loss_sum, correct, weight)``, three scalars: sums, so that devices'
    or batches' partial sums add up to the global ones.
  """
  targets = batch["targets"]
  weights = batch.get("weights")
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), targets
  )
  correct = logits.argmax(-1) == targets
  return (loss * weights).sum(), (correct * weights).sum(), weights.sum()


def mean_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
  """The weighted mean of the loss over ``batch``: ``weighted_sums``'s loss
  sum over its weight (0 for a batch of weight 0)."""
  loss_sum, _, weight = weighted_sums(logits, batch)
  return loss_sum / jnp.maximum(weight, 1.0)
