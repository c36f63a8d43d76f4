"""The digest of a model's parameters, in NumPy alone.

``train.metrics.params_digest`` (JAX params) and the PyTorch peer of the
cluster benchmark, which must not import JAX, hash with this one function,
so that the same parameters give the same digest in both frameworks.
"""

from collections.abc import Iterable
import hashlib

import numpy as np


def sha256(arrays: Iterable[np.ndarray]) -> str:
  """SHA-256 of the arrays' bytes (each in C order), one after another."""
  digest = hashlib.sha256()
  for x in arrays:
    digest.update(np.asarray(x).tobytes())
  return digest.hexdigest()
