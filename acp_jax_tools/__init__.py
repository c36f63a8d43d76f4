"""acp_jax_tools: the measurement tools beside the library ``acp_jax``: the
advice, the cost model, simulated devices, timing, and reading compiled HLO.

``advice`` (which compressor, at which rank, for a model on a link) rests on
``measure`` (what it measures), ``calibration`` (its threshold on the
error), ``costmodel`` (an alpha-beta model of a step), ``simulated``
(several devices simulated by ``jax.vmap``), ``steps`` (short training runs)
and ``timing`` (an update's wall time on one device); ``hlo`` reads a
compiled step's collectives. They import ``acp_jax``; ``acp_jax`` imports
none of them, since training needs none: ``acp_jax.advise``,
``acp_jax.Advice``, ``acp_jax.advice`` and ``acp_jax.hlo`` import theirs
from here on first use.
"""
