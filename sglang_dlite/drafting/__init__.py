"""The speculative core: what every engine, trainer and benchmark of this project shares.

One definition each, pure torch (imports no sglang), used by the reference engine
(``engine.py``), the sglang DLITE worker, training evaluation and the benchmarks:

- ``accept``:   batched greedy acceptance (longest matching prefix + bonus) and chain rejection
                sampling (standard speculative sampling, deterministic or sampled drafts);
- ``tau``:      the acceptance length τ = committed tokens per verify round, prefill excluded;
- ``context``:  the drafter's context window: the last C committed positions (``context_positions``),
                their rows + validity;
- ``sampling``: temperature / top-k / top-p filters that turn logits into the target's law;
- ``verify_width``: how many drafts a round verifies where a verify row is not free (a CPU): one
                width per batch (``VerifyWidthPolicy``) or per row (``select_drafts``).
"""

from sglang_dlite.drafting.accept import chain_rejection_sample, greedy_accept, greedy_accept_length  # noqa: F401
from sglang_dlite.drafting.context import context_positions, last_rows, last_rows_of_segments  # noqa: F401
from sglang_dlite.model.sampling import filter_top_k_top_p, logits_to_probs  # noqa: F401
from sglang_dlite.drafting.tau import tau_of_requests, tau_of_rounds  # noqa: F401
