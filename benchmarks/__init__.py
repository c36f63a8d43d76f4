"""The paper's evaluation, reproduced: ``python -m benchmarks SUBCOMMAND``.

Subcommands (each prints a table and writes ``results/SUBCOMMAND.json``):
``comm`` (bytes and collectives per step, accounting against compiled HLO),
``overhead`` (compute each compressor adds), ``convergence`` (the five
methods trained side by side) and ``report`` (``results/REPORT.md`` with
plots).
"""
