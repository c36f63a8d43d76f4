"""Eight simulated CPU devices, set before any test starts the backend."""

import jax

NUM_DEVICES = 8

jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
