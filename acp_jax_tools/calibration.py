"""The advice's threshold on a candidate's error, calibrated on the
convergence records (``python -m benchmarks advise --calibrate`` writes
them into ``CALIBRATION_FILE``, shipped with the package)."""

from collections.abc import Sequence
import dataclasses
import importlib.resources
import json
import math
from typing import Any

# The held-out loss gap to S-SGD (as a fraction) that the threshold promises
# by default.
MAX_GAP = 0.10
# The records the threshold is calibrated on (see ``Calibration``).
CALIBRATION_FILE = "advice_calibration.json"


def positive_number(name: str, value: Any) -> float:
  """``value`` as a float; raises unless it is a number > 0 (inf too)."""
  if (
      isinstance(value, bool)
      or not isinstance(value, (int, float))
      or math.isnan(value)
      or value <= 0
  ):
    raise ValueError(f"{name} must be a positive number, got {value!r}")
  return float(value)


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
  """A recorded variant: its measured error (``error_to_noise``) and
  cosine, and its held-out loss gap to S-SGD (a fraction: 0.05 is 5 % above
  S-SGD's loss)."""

  variant: str
  error_to_noise: float
  cosine: float
  gap: float


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The threshold on the error, and the records it comes from.

  ``error_to_noise`` is the highest recorded error at and below which every
  recorded variant ended within ``max_gap`` of S-SGD's held-out loss (0.0,
  S-SGD alone, if none did).
  """

  error_to_noise: float
  max_gap: float
  points: tuple[CalibrationPoint, ...]
  source: str

  @classmethod
  def from_points(
      cls, points: Sequence[CalibrationPoint], max_gap: float, source: str
  ) -> "Calibration":
    positive_number("max_gap", max_gap)
    ordered = sorted(points, key=lambda p: p.error_to_noise)
    threshold = 0.0
    for point in ordered:
      if point.gap > max_gap:
        break
      threshold = point.error_to_noise
    return cls(threshold, max_gap, tuple(ordered), source)

  def admits(self, error_to_noise: float) -> bool:
    """Whether a candidate of this measured error is within the
    threshold."""
    return error_to_noise <= self.error_to_noise

  @classmethod
  def recorded(cls, max_gap: float = MAX_GAP) -> "Calibration":
    """From the convergence records shipped with the package
    (``CALIBRATION_FILE``, written from them by ``python -m benchmarks
    advise --calibrate``)."""
    text = (
        importlib.resources.files("acp_jax_tools")
        .joinpath(CALIBRATION_FILE)
        .read_text()
    )
    data = json.loads(text)
    points = [
        CalibrationPoint(
            p["variant"], p["error_to_noise"], p["cosine"], p["gap"]
        )
        for p in data["points"]
    ]
    return cls.from_points(points, max_gap, data["source"])

  def describe(self) -> str:
    """The threshold and why, in a sentence or two."""
    within = [p for p in self.points if self.admits(p.error_to_noise)]
    above = [p for p in self.points if not self.admits(p.error_to_noise)]
    text = (
        f"threshold: error/noise <= {self.error_to_noise:.3f}, at and below"
        " which every recorded variant ended within"
        f" {100 * self.max_gap:.1f} % of S-SGD's held-out loss ("
        + ", ".join(
            f"{p.variant} {p.error_to_noise:.3f} (cosine {p.cosine:.3f}):"
            f" {100 * p.gap:+.1f} %"
            for p in within
        )
        + ")"
    )
    if above:
      p = above[0]
      text += (
          f"; the next above it, {p.variant} at {p.error_to_noise:.3f}"
          f" (cosine {p.cosine:.3f}), ended {100 * p.gap:+.1f} %"
      )
    return text + f". Records: {self.source}."
