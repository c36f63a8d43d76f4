"""Orbax checkpoints of the whole training state.

A checkpoint holds the train state (params, batch statistics, the optimizer
state with every device's residuals and the P/Q factors, the step and the RNG
key) and a JSON record (step, data position, the compressor's phase index).
Orbax writes each to a temporary directory and renames it when complete, so
a crash mid-save leaves the previous checkpoint as the latest.

ACP-SGD's phase is static (part of the state's tree structure, not an array),
so a restore needs the right structure as its target: the caller passes the
abstract states of one phase cycle and the record says which one was saved.
"""

import os
from typing import Any, Sequence

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every ``every_steps`` steps, keeps the last ``keep``."""

  def __init__(self, directory: str, *, keep: int):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            # Saving synchronously keeps one code path on every platform; a
            # save costs a fraction of a step here.
            enable_async_checkpointing=False,
        ),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
    self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            record=ocp.args.JsonSave(record),
        ),
    )
    self._manager.wait_until_finished()

  def restore(self, step: int, cycle: Sequence[Any]) -> tuple[Any, dict]:
    """The state saved at ``step`` and its record.

    Args:
      step: a saved step.
      cycle: abstract states (``jax.ShapeDtypeStruct`` leaves with shardings)
        of consecutive steps, one per structure the state cycles through; the
        record's ``phase`` indexes it.
    """
    record = self._manager.restore(
        step, args=ocp.args.Composite(record=ocp.args.JsonRestore())
    ).record
    target = cycle[record["phase"]]
    state = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target)),
    ).state
    return state, record

  def close(self) -> None:
    self._manager.close()


def abstract(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves with the arrays' shardings."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      tree,
  )
