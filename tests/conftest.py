"""Eight simulated CPU devices, set before any test starts the backend."""

import jax

import acp_jax

NUM_DEVICES = 8

jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
# The compressors' small QR factors are fastest on one BLAS thread (see
# acp_jax.limit_lapack_threads), as in the trainer and the benchmarks.
acp_jax.limit_lapack_threads(1)
