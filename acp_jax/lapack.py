"""The threads of the LAPACK calls in XLA:CPU's programs.

On a CPU, jaxlib runs QR, Cholesky and triangular solves through SciPy's
LAPACK, in SciPy's wheels a bundled OpenBLAS that starts one thread per
core. The low-rank factors are far too small to share among threads, and
OpenBLAS's threads spin against XLA's own pool: on 2 cores, QR of a 768 x 32
factor took 0.70 ms at 2 threads against 0.18 ms at 1 (BERT-Base's 75
rank-32 factors, 92 ms against 19 ms).
"""

import threadpoolctl

from acp_jax import _checks


def limit_lapack_threads(
    num_threads: int = 1,
) -> threadpoolctl.threadpool_limits:
  """Runs every BLAS library loaded in the process, the one behind jaxlib's
  LAPACK calls included, on at most ``num_threads`` threads.

  A process-wide setting of the BLAS libraries (NumPy's too), made through
  ``threadpoolctl``; XLA's own thread pool is untouched. The trainer and the
  benchmarks call it once at start (``python -m train --lapack_threads``);
  a user's own loop calls it, or uses its result as a context manager.

  Example::

    acp_jax.limit_lapack_threads()  # from here on
    with acp_jax.limit_lapack_threads(1):  # only within the block
      ...

  Args:
    num_threads: a positive int.

  Returns:
    threadpoolctl's limiter: ``restore_original_limits()`` undoes it, and
    leaving it as a context manager does too.
  """
  _checks.integer("num_threads", num_threads, 1)
  # threadpoolctl sees only loaded libraries, and jaxlib loads SciPy's LAPACK
  # at its first call: load it now.
  # pylint: disable-next=g-import-not-at-top,unused-import
  import scipy.linalg.cython_lapack

  return threadpoolctl.threadpool_limits(limits=num_threads, user_api="blas")
