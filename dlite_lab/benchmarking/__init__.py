"""What the benchmarks in ``bench/`` share, as a public part of the package (bench scripts import
only the installed package, never each other or the tests); each module's docstring names the
scripts and tests that use it: ``draft_rounds`` (draft cost vs context, its table and plot),
``random_models`` (random-weight targets and drafters), ``bad_requests`` and ``soak_report`` (the soak).
"""
