"""Setting JAX up before its backend starts: simulated devices, processes."""

import os
import signal
import sys
import threading

import acp_jax
import jax
from jax.experimental import multihost_utils
import numpy as np


def setup(
    *,
    num_cpu_devices: int | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto_distributed: bool = False,
    distributed_timeout_s: int = 300,
    lapack_threads: int | None = 1,
) -> None:
  """Simulates CPU devices and joins a multi-process cluster, as asked, and
  limits the BLAS threads of jaxlib's LAPACK calls.

  Must run before anything asks JAX for its devices.

  Args:
    num_cpu_devices: simulate this many CPU devices (in each process).
    coordinator_address: ``host:port`` of process 0; with ``num_processes``
      and ``process_id``, calls ``jax.distributed.initialize`` with them.
    num_processes: processes in the cluster.
    process_id: this process's index.
    auto_distributed: ``jax.distributed.initialize()`` with no arguments, for
      clusters JAX detects by itself (SLURM, Cloud TPU, ...).
    distributed_timeout_s: how long to wait for every process to join, and
      for a silent peer, before the run fails.
    lapack_threads: threads of the process's BLAS libraries, the one behind
      jaxlib's QR and Cholesky included (``acp_jax.limit_lapack_threads``:
      one is faster for the compressors' small factors); None leaves them as
      they are.
  """
  if lapack_threads is not None:
    acp_jax.limit_lapack_threads(lapack_threads)
  if num_cpu_devices is not None:
    if num_cpu_devices < 1:
      raise ValueError(
          f"--num_cpu_devices must be positive, got {num_cpu_devices}"
      )
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", num_cpu_devices)
  explicit = (coordinator_address, num_processes, process_id)
  if any(x is not None for x in explicit):
    if any(x is None for x in explicit):
      raise ValueError(
          "--coordinator_address, --num_processes and --process_id go"
          f" together, got {explicit}"
      )
    if auto_distributed:
      raise ValueError("--auto_distributed excludes --coordinator_address")
  if any(x is not None for x in explicit) or auto_distributed:
    # Collectives between CPU processes go over gloo (TCP).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX aborts the process when the time is up, with a message that names
    # neither side: say here what is being waited for.
    print(
        f"process {process_id} of {num_processes}: joining the coordinator at"
        f" {coordinator_address or '(detected)'}; the run fails if the other"
        f" processes have not all joined within {distributed_timeout_s} s"
        " (--distributed_timeout_s)",
        file=sys.stderr,
        flush=True,
    )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=distributed_timeout_s,
        heartbeat_timeout_seconds=distributed_timeout_s,
    )


class Interrupted(Exception):
  """Training stopped on a signal after saving a checkpoint at ``step``."""

  def __init__(self, signal_name: str, step: int):
    super().__init__(
        f"stopped by {signal_name} at step {step}; a checkpoint of that step"
        " is saved, and running the same command again resumes from it"
    )
    self.signal_name = signal_name
    self.step = step


class StopRequests:
  """SIGTERM and SIGINT ask training to save and stop at a step boundary.

  In one process, a handler notes the signal and ``should_stop`` reports it
  at the next step. Across processes, all must stop at the same step: JAX's
  preemption service, which ``jax.distributed`` starts and which catches
  SIGTERM itself, agrees on that step (``reached_preemption_sync_point``);
  SIGINT is turned into a SIGTERM to reach it.
  """

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    if jax.process_count() == 1:
      self._catch(signal.SIGTERM, self._note)
    self._catch(signal.SIGINT, self._note if jax.process_count() == 1 else self._forward)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    return False

  def _catch(self, signum, handler):
    if threading.current_thread() is threading.main_thread():
      self._previous[signum] = signal.signal(signum, handler)

  def _note(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def _forward(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    os.kill(os.getpid(), signal.SIGTERM)

  def should_stop(self, step: int) -> bool:
    """Whether to save and stop after ``step`` (every process calls it at
    every step)."""
    if jax.process_count() == 1:
      return self.signal_name is not None
    if multihost_utils.reached_preemption_sync_point(step):
      self.signal_name = self.signal_name or "SIGTERM"
      return True
    return False


def check_shared_workdir(workdir: str) -> None:
  """Raises in every process unless all processes see one ``workdir``.

  Orbax writes each checkpoint into one directory from all processes
  together; with a directory per process the first save waits forever for a
  commit that happens elsewhere.
  """
  if jax.process_count() == 1:
    return
  token = int(
      multihost_utils.broadcast_one_to_all(
          np.random.default_rng().integers(2**62, dtype=np.int64)
      )
  )
  path = os.path.join(workdir, ".process_0_token")
  if jax.process_index() == 0:
    with open(path + ".tmp", "w") as f:
      f.write(str(token))
    os.replace(path + ".tmp", path)
  multihost_utils.sync_global_devices("acp_jax workdir token written")
  try:
    with open(path) as f:
      sees = f.read() == str(token)
  except FileNotFoundError:
    sees = False
  seen = multihost_utils.process_allgather(np.int32(sees))
  blind = [i for i, ok in enumerate(np.ravel(seen)) if not ok]
  if blind:
    raise ValueError(
        f"--workdir={workdir} must be one directory shared by every process"
        " (checkpoints are written there by all of them together), but"
        f" process(es) {blind} do not see the file process 0 wrote there"
    )
