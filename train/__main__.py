"""Trains a model with a gradient compressor.

  python -m train --config configs/default.py --workdir /tmp/digits \
      --config.compressor.name=acp_sgd --config.compressor.acp_sgd.rank=4 \
      --num_cpu_devices 8

Running the same command again resumes from the latest checkpoint in
``--workdir``.
"""

import os
import signal
import sys

# Exit status after SIGTERM, SIGINT or SIGHUP, once the checkpoint is saved: a
# temporary failure (sysexits' EX_TEMPFAIL), retrying resumes.
EXIT_INTERRUPTED = 75


def _stopped_outside_a_step(signum, frame):
  """A signal before training starts (imports, joining, compiling) or after
  it ends: one line, not a silent death; no step is cut short.

  Exits at once (``os._exit``): a ``SystemExit`` raised here is swallowed
  when the signal lands inside a callback that ignores exceptions (JAX's
  garbage-collection hook), and the run would go on. Nothing is lost:
  checkpoints are written atomically, and none is half-made outside a step.
  """
  del frame
  print(
      f"stopped by {signal.Signals(signum).name} before training started or"
      " after it ended: no step was cut short, and the workdir holds every"
      " checkpoint saved. Run the same command again to resume.",
      file=sys.stderr,
      flush=True,
  )
  sys.stdout.flush()
  os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access


# Before the imports, which take seconds; training catches these signals
# itself while it runs (runtime.StopRequests) and saves before it stops. Not
# in the data workers, which import this module under another name.
if __name__ == "__main__":
  for _signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_signum, _stopped_outside_a_step)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from train import checks
from train import checkpoint
from train import config as config_lib
from train import loop
from train import metrics as metrics_lib
from train import plots
from train import runtime
from train import train

# pylint: enable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Checkpoints, metrics.jsonl and TensorBoard summaries (tensorboard/) go"
    " here.",
)
_NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", None, "Simulate this many CPU devices per process."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_COMPARE = flags.DEFINE_list(
    "compare",
    None,
    "Train once per compressor named here (e.g. ssgd,acp_sgd), each in"
    " WORKDIR/NAME, print them side by side and draw their curves into"
    " WORKDIR/comparison.png.",
)
_AUTO_DISTRIBUTED = flags.DEFINE_bool(
    "auto_distributed", False, "Let JAX detect the cluster (SLURM, ...)."
)
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s",
    300,
    "Seconds to wait for all processes to join, or for a silent peer, before"
    " the run fails.",
)
_LAPACK_THREADS = flags.DEFINE_integer(
    "lapack_threads",
    1,
    "Threads of the BLAS behind jaxlib's QR and Cholesky (one is faster for"
    " the compressors' small factors); 0 leaves the library's own setting.",
)
flags.mark_flags_as_required(["config", "workdir"])


def _config_file(argv) -> str | None:
  """The value of ``--config=F`` or ``--config F`` in ``argv``."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.partition("=")[2]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _parse_flags(argv):
  # ml_collections reports a file without get_config() as an unknown
  # attribute, and takes whatever get_config() returns: checked here first,
  # so that the message names the file.
  if (path := _config_file(argv)) is not None:
    try:
      config_lib.load_file(path)
    except ValueError as e:
      raise SystemExit(str(e)) from None
  try:
    parsed = flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # ml_collections' unknown override
    overrides = [a for a in argv if a.startswith("--config.")]
    detail = e.args[0] if e.args else ""
    while isinstance(detail, Exception):  # AttributeError(KeyError(text))
      detail = detail.args[0] if detail.args else ""
    raise SystemExit(
        f"unknown config key in {' '.join(overrides)}: {detail}"
    ) from None
  try:
    _check_flags()
  except ValueError as e:
    raise SystemExit(str(e)) from None
  return parsed


def _check_flags() -> None:
  """Raises ``ValueError`` naming a flag out of its range."""
  for flag, low in (
      (_NUM_CPU_DEVICES, 1),
      (_NUM_PROCESSES, 1),
      (_PROCESS_ID, 0),
  ):
    if flag.value is not None:
      checks.int_in(f"--{flag.name}", flag.value, low)
  if _PROCESS_ID.value is not None and _NUM_PROCESSES.value is not None:
    checks.int_in(
        "--process_id", _PROCESS_ID.value, 0, _NUM_PROCESSES.value - 1
    )
  checks.int_in("--distributed_timeout_s", _DISTRIBUTED_TIMEOUT.value, 1)
  checks.int_in("--lapack_threads", _LAPACK_THREADS.value, 0)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs each file it writes
  checkpoint.log_abandoned_reads()
  runtime.setup(
      num_cpu_devices=_NUM_CPU_DEVICES.value,
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
      auto_distributed=_AUTO_DISTRIBUTED.value,
      distributed_timeout_s=_DISTRIBUTED_TIMEOUT.value,
      lapack_threads=_LAPACK_THREADS.value or None,
  )
  config, workdir = _CONFIG.value, _WORKDIR.value
  try:
    if not _COMPARE.value:
      summary = train.train_and_evaluate(config, workdir)
      print(metrics_lib.format_summary(summary))
      return
    summaries = []
    for name in _COMPARE.value:
      with config.unlocked():
        config.compressor.name = name
      summaries.append(
          train.train_and_evaluate(config, os.path.join(workdir, name))
      )
    print(metrics_lib.format_comparison(summaries))
    if jax.process_index() == 0:
      runs = {name: os.path.join(workdir, name) for name in _COMPARE.value}
      if path := plots.draw_comparison(runs, workdir):
        print(f"curves: {path}")
  except runtime.Interrupted as e:
    print(e, file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)
  except runtime.PeerLost as e:
    print(e, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # JAX's exit hooks would wait on the failed collective and on the peer,
    # then abort: the run ends here, as a peer that never joins ends it.
    os._exit(runtime.EXIT_PEER_LOST)
  except (checks.ConfigError, checks.Refused) as e:
    raise SystemExit(str(e)) from None
  except loop.TooManySkipped as e:
    print(metrics_lib.format_summary(e.summary))
    print(e, file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
