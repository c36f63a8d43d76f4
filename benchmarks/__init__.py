"""The paper's evaluation, reproduced: ``python -m benchmarks SUBCOMMAND``.

Each subcommand is the module of this package it is named after (``HELP``,
``add_arguments`` and ``main``, see ``benchmarks.cli``); ``python -m
benchmarks --help`` lists them. Each measuring subcommand prints a table and
writes ``results/NAME.json``; ``report`` turns those into
``results/REPORT.md`` with plots.
"""

# In the order of the report's sections.
SUBCOMMANDS = (
    "comm",
    "overhead",
    "convergence",
    "cluster",
    "overlap_step",
    "quality",
    "project",
    "sign_scaling",
    "gpu",
    "pipeline",
    "advise",
    "report",
)
