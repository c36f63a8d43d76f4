"""A full disk, as the trainer's writers meet it: recognized however the
library that wrote wraps it, and reported as one line naming the path."""

import errno


def no_space(error: BaseException) -> bool:
  """Whether a full disk is at the root of ``error``, at any depth."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if getattr(error, "errno", None) == errno.ENOSPC or (
        "No space left on device" in str(error)
    ):
      return True
    error = error.__cause__ or error.__context__
  return False


def full(what: str, path) -> OSError:
  """ENOSPC saying that ``what`` could not be written to ``path``."""
  return OSError(
      errno.ENOSPC,
      f"No space left on device: {what} could not be written to {path}; the"
      " checkpoints saved before are kept as they were. Free some space and"
      " run again to resume.",
  )
