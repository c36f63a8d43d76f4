"""Setting JAX up before its backend starts (simulated devices, processes)
and what the processes of a run settle at its start: one config, one
workdir that no other run uses, where to stop on a signal."""

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
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
    _join_cluster(
        coordinator_address, num_processes, process_id, distributed_timeout_s
    )


def _join_cluster(
    coordinator_address, num_processes, process_id, timeout_s
) -> None:
  """``jax.distributed.initialize`` with these arguments (all None: detected),
  CPU collectives over gloo, waiting ``timeout_s`` for the other processes."""
  # Collectives between CPU processes go over gloo (TCP).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX aborts the process when the time is up, with a message that names
  # neither side: say here what is being waited for.
  print(
      f"process {process_id} of {num_processes}: joining the coordinator at"
      f" {coordinator_address or '(detected)'}; the run fails if the other"
      f" processes have not all joined within {timeout_s} s"
      " (--distributed_timeout_s)",
      file=sys.stderr,
      flush=True,
  )
  # JAX's own timeout aborts the process with "another task died" where
  # none did: this watchdog ends it first, with a line that says what
  # happened; JAX's is set past it.
  watchdog = threading.Timer(
      timeout_s,
      _not_joined,
      (coordinator_address, num_processes, process_id, timeout_s),
  )
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s + JOIN_GRACE_S,
        heartbeat_timeout_seconds=timeout_s + JOIN_GRACE_S,
    )
  finally:
    watchdog.cancel()
  global _silent_peer_s
  _silent_peer_s = timeout_s


# Seconds JAX's own timeouts (to join, and a peer's heartbeat) run past the
# trainer's watchdogs.
JOIN_GRACE_S = 30
# Seconds a step may wait on the other processes: --distributed_timeout_s,
# set once this process has joined them; None in a single process.
_silent_peer_s = None
# Exit status of a process whose peers did not all join.
EXIT_NOT_JOINED = 69  # sysexits' EX_UNAVAILABLE


def _not_joined(coordinator_address, num_processes, process_id, timeout_s):
  print(
      f"process {process_id} of {num_processes}: the other processes did not"
      f" all join the coordinator at {coordinator_address or '(detected)'}"
      f" within {timeout_s} s (--distributed_timeout_s), so no step ran."
      " Start every process with the same --coordinator_address and"
      " --num_processes, each with its own --process_id; a rerun resumes"
      " from the latest checkpoint in the workdir, if there is one.",
      file=sys.stderr,
      flush=True,
  )
  os._exit(EXIT_NOT_JOINED)  # the main thread is blocked inside JAX


# Exit status of a process whose peer stopped during the run.
EXIT_PEER_LOST = 76  # sysexits' EX_PROTOCOL: the remote side failed
# What a collective between processes raises when a peer is gone: gloo's
# (CPU) or NCCL's (GPU) error, or the socket's.
_PEER_FAILURE = re.compile(r"\b(Gloo|NCCL)\b[^\n]* failed|by peer")


class PeerLost(Exception):
  """A collective failed during ``step`` because another process of the run
  stopped (killed, or its machine lost); ``checkpoint`` is the step of the
  newest checkpoint known good, or None."""

  def __init__(
      self,
      step: int,
      checkpoint: int | None,
      cause: str,
      during: str | None = None,
  ):
    resume = (
        f"resumes from checkpoint {checkpoint}"
        if checkpoint is not None
        else "starts over: no checkpoint was saved"
    )
    super().__init__(
        f"process {jax.process_index()} of {jax.process_count()}: another"
        f" process of the run stopped during {during or f'step {step}'}"
        f" ({cause}), so this"
        " one stops too. Run the same command again in every process: the"
        f" run {resume}."
    )


def peer_lost(
    error: Exception, step: int, checkpoint: int | None
) -> PeerLost | None:
  """``PeerLost`` if ``error``, raised by JAX in a run of several
  processes, is a collective's failure to reach a peer, else None."""
  text = str(error)
  if jax.process_count() == 1 or not _PEER_FAILURE.search(text):
    return None
  return PeerLost(step, checkpoint, text.strip().splitlines()[0])


@contextlib.contextmanager
def waiting_on_peers(
    step: int, checkpoint: int | None, during: str | None = None
):
  """A block that waits on the other processes, for ``step``'s collectives
  or for what ``during`` names (the evaluation or the checkpoint save after
  it): if it waits longer than --distributed_timeout_s, the process ends
  with ``PeerLost``'s line and ``EXIT_PEER_LOST``. A peer killed or frozen
  mid-step (or mid-save) can leave a collective or a barrier waiting
  without an error (gloo does not always see the connection go), until
  JAX's heartbeat aborts the process; this watchdog ends it first."""
  if _silent_peer_s is None:
    yield
    return
  cause = f"it waited {_silent_peer_s} s (--distributed_timeout_s)"
  watchdog = threading.Timer(
      _silent_peer_s,
      _peer_silent,
      (PeerLost(step, checkpoint, cause, during),),
  )
  watchdog.daemon = True
  watchdog.start()
  try:
    yield
  finally:
    watchdog.cancel()


def _peer_silent(lost: PeerLost) -> None:
  print(lost, file=sys.stderr, flush=True)
  os._exit(EXIT_PEER_LOST)  # the main thread is blocked inside JAX


def new_run_id() -> str:
  """A random id for a run that starts from scratch, the same in every
  process: 16 hex digits."""
  words = np.random.default_rng().integers(0, 2**31, size=2, dtype=np.int32)
  if jax.process_count() > 1:
    words = np.asarray(multihost_utils.broadcast_one_to_all(words))
  return "".join(f"{int(w):08x}" for w in words)


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
  """SIGTERM, SIGINT and SIGHUP (a closed terminal) ask training to save
  and stop at a step boundary.

  In one process, a handler notes the signal and ``should_stop`` reports it
  at the next step. Across processes, all must stop at the same step: JAX's
  preemption service, which ``jax.distributed`` starts and which catches
  SIGTERM itself, agrees on that step (``reached_preemption_sync_point``);
  SIGINT and SIGHUP are turned into a SIGTERM to reach it.
  """

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    single = jax.process_count() == 1
    if single:
      self._catch(signal.SIGTERM, self._note)
    for signum in (signal.SIGINT, signal.SIGHUP):
      self._catch(signum, self._note if single else self._forward)
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


class WorkdirLock:
  """``workdir/.lock``, held while a run trains in ``workdir``.

  Process 0 holds an exclusive ``flock`` on it and writes there its pid,
  host and start time. The kernel drops the lock when the process exits,
  however it exits, so the file a killed run leaves behind holds nothing
  back. Every process learns whether process 0 got the lock, so that a run
  refused is refused in all its processes before any step.

  Raises (on entering):
    RuntimeError: if another run holds ``workdir``, naming its pid, host and
      start time.
    ValueError: if ``workdir/.lock`` is a symbolic link, naming it.
  """

  # What process 0 found, as it tells the others.
  HELD, BUSY, LINK = 0, 1, 2

  def __init__(self, workdir: str):
    self._workdir = workdir
    self._path = os.path.join(workdir, ".lock")
    self._file = None

  def __enter__(self):
    found = self._acquire() if jax.process_index() == 0 else self.HELD
    if jax.process_count() > 1:
      found = int(multihost_utils.broadcast_one_to_all(np.int32(found)))
    if found == self.LINK:
      raise ValueError(
          f"{self._path} is a symbolic link; the run's lock is never taken"
          f" through one: remove it (rm {self._path}) and run again"
      )
    if found == self.BUSY:
      raise RuntimeError(
          f"--workdir={self._workdir} is in use by another run"
          f" ({self._holder()}, holding {self._path}): two runs in one"
          " workdir would write over each other's checkpoints and metrics."
          " Wait for that run to end, stop it, or use another workdir."
      )
    return self

  def __exit__(self, *exc):
    if self._file is not None:
      self._file.close()  # closing the file releases the lock
      self._file = None
    return False

  def _acquire(self) -> int:
    """``HELD`` once locked, else ``BUSY`` or ``LINK``."""
    try:
      # O_NOFOLLOW: a symlink out of the workdir is never written through.
      fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      return self.LINK
    f = os.fdopen(fd, "r+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.close()
      return self.BUSY
    f.truncate()
    f.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now().isoformat(
                    timespec="seconds"
                ),
            }
        )
    )
    f.flush()
    self._file = f
    return self.HELD

  def _holder(self) -> str:
    try:
      with open(self._path) as f:
        holder = json.load(f)
      return (
          f"pid {holder['pid']} on {holder['host']}, started"
          f" {holder['started']}"
      )
    except (OSError, ValueError, KeyError, TypeError):
      return "a run that has not yet written its pid"


def check_same_config(config) -> None:
  """Raises in every process unless all processes of the run have one config.

  The processes all-gather a 32-byte digest of their config; only if the
  digests differ are the configs themselves gathered, to name the keys that
  differ. Both exchanges have the same shapes in every process, so they run
  before anything that a different config would change.
  """
  if jax.process_count() == 1:
    return
  text = json.dumps(config.to_dict(), sort_keys=True, default=repr).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest))
  if (digests == digests[0]).all():
    return
  sizes = np.ravel(multihost_utils.process_allgather(np.int32(len(text))))
  padded = np.zeros(sizes.max(), np.uint8)
  padded[: len(text)] = np.frombuffer(text, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(padded))
  configs = [json.loads(row[:n].tobytes()) for row, n in zip(rows, sizes)]
  differ = [
      f"config.{key}: process 0 has {first!r}, process {i} has {other!r}"
      for i, config_i in enumerate(configs[1:], start=1)
      for key, first, other in _differences(configs[0], config_i)
  ]
  raise ValueError(
      "the processes of this run have different configs: "
      + "; ".join(differ)
      + ". Start every process with the same config file and overrides."
  )


def _differences(a, b, prefix: str = ""):
  """``(key, a's value, b's value)`` for each dotted key whose values differ
  between two nested dicts (``None`` where a key is missing)."""
  if not (isinstance(a, dict) and isinstance(b, dict)):
    if a != b:
      yield prefix, a, b
    return
  for key in sorted(set(a) | set(b)):
    name = f"{prefix}.{key}" if prefix else key
    yield from _differences(a.get(key), b.get(key), name)
