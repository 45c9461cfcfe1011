"""The evaluation lab beside the product: the reference engine and its drafters, training,
baselines, workloads, benchmarking and the demo commands. Never packed into the sglang-dlite
wheel, never imported by ``sglang_dlite`` (``python_tests/test_boundaries.py``); installed by
the Makefile as part of the source checkout."""
