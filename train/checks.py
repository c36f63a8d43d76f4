"""The trainer's checks of ints and numbers.

Each raises ``ValueError`` naming the argument (or config key) and the value,
so a bad config or call fails before anything is loaded or compiled. An int
is Python's or NumPy's, never a bool.
"""

import math
import numbers


class ConfigError(ValueError):
  """A config key or a flag of another kind or out of its range: the
  trainer's command line prints its message alone, one line."""


class Refused(ValueError):
  """A workdir this run cannot resume as it is: another run's checkpoints
  or log, another state layout or checkpoint format, a changed dataset, or
  checkpoints none of which verifies. The trainer's command line prints its
  message alone, one line; nothing in the workdir was changed."""


def is_int(value) -> bool:
  """Whether ``value`` is an int (Python's or NumPy's) and not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value, minimum: int) -> None:
  """Raises unless ``value`` is an int of at least ``minimum``, 0 or 1: the
  message says "a positive int" or "a non-negative int"."""
  if not is_int(value) or value < minimum:
    kind = "positive" if minimum == 1 else "non-negative"
    raise ValueError(f"{name} must be a {kind} int, got {value!r}")


def int_in(name: str, value, low: int, high: int | None = None) -> None:
  """Raises unless ``value`` is an int in ``[low, high]`` (no upper bound
  for None)."""
  if not is_int(value) or value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def number(
    name: str,
    value,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
  """Raises unless ``value`` is a finite real number (not a bool) in the
  interval from ``low`` to ``high``, each end open or closed."""
  ok = (
      isinstance(value, numbers.Real)
      and not isinstance(value, bool)
      and math.isfinite(value)
      and (value > low if low_open else value >= low)
      and (value < high if high_open or high == math.inf else value <= high)
  )
  if not ok:
    interval = (
        f"{'(' if low_open else '['}{low}, {high}"
        f"{')' if high_open or high == math.inf else ']'}"
    )
    raise ValueError(
        f"{name} must be a finite number in {interval}, got {value!r}"
    )
