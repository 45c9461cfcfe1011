"""What the benchmarks in ``bench/`` share, as a public part of the package (bench scripts import
only the installed package, never each other or the tests):

- ``draft_rounds``: random-weight drafters (DLite, the KV baselines, n-gram, suffix) drafting
  simulated mid-conversation rounds at a given context length (``bench/draft_cost.py``,
  ``bench/draft_latency.py``);
- ``draft_cost_report``: the draft-cost table and plot (``bench/draft_cost.py``, ``bench/report.py``);
- ``random_models``: random-weight tiny targets and DLite drafters for any target (the e2e / GPU
  checks without a trained checkpoint; the sglang tests);
- ``bad_requests``: inputs a server must refuse with a readable 4xx (``bench/soak.py``, the tests);
- ``soak_report``: the soak's /metrics counters, RSS slopes, request table and plot (``bench/soak.py``).
"""
