"""Setting JAX up before its backend starts: simulated devices, processes."""

import jax


def setup(
    *,
    num_cpu_devices: int | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto_distributed: bool = False,
) -> None:
  """Simulates CPU devices and joins a multi-process cluster, as asked.

  Must run before anything asks JAX for its devices.

  Args:
    num_cpu_devices: simulate this many CPU devices (in each process).
    coordinator_address: ``host:port`` of process 0; with ``num_processes``
      and ``process_id``, calls ``jax.distributed.initialize`` with them.
    num_processes: processes in the cluster.
    process_id: this process's index.
    auto_distributed: ``jax.distributed.initialize()`` with no arguments, for
      clusters JAX detects by itself (SLURM, Cloud TPU, ...).
  """
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
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
