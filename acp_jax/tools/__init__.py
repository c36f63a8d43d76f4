"""The measurement tools: the advice, the cost model, simulated devices,
timing, and reading compiled HLO.

``advice`` (which compressor, at which rank, for a model on a link) rests on
``measure`` (what it measures), ``calibration`` (its threshold on the
error), ``costmodel`` (an alpha-beta model of a step), ``simulated``
(several devices simulated by ``jax.vmap``) and ``timing`` (an update's
wall time on one device); ``hlo`` reads a compiled step's collectives.
None of them is loaded by ``import acp_jax``: training needs none, and
``acp_jax.advise``, ``acp_jax.Advice``, ``acp_jax.advice`` and
``acp_jax.hlo`` import theirs on first use.
"""
