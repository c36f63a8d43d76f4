"""Orbax checkpoints of the whole training state.

A checkpoint holds the train state (params, batch statistics, the
compressor's state with every device's residuals but its factors once, the
optimizer's state, the step and the RNG key) and a JSON record (step, data
position). Orbax writes each to a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint as the latest.
The restore target comes from ``acp_jax.checkpoint.target``: ACP-SGD's phase
from the checkpoint, everything else checked against the live state.
"""

import os
from typing import Any

import orbax.checkpoint as ocp

from acp_jax import checkpoint as acp_checkpoint


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

  def restore(self, step: int, like: Any) -> tuple[Any, dict]:
    """The state saved at ``step``, laid out like ``like``, and its record."""
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(
                acp_checkpoint.target(
                    os.path.join(self._manager.directory, str(step), "state"),
                    like,
                )
            ),
            record=ocp.args.JsonRestore(),
        ),
    )
    return restored.state, restored.record

  def close(self) -> None:
    self._manager.close()

