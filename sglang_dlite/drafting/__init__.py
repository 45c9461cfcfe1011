"""One round's drafting, verify and acceptance, batched (B >= 1), shared by the sglang worker and
the lab's reference engine. Pure torch and python: imports no sglang.

- ``accept``:  greedy acceptance (longest matching prefix + bonus) and chain rejection sampling
               (standard speculative sampling, deterministic or sampled drafts);
- ``tree``:    token trees (``DraftTree``: mask, positions, greedy / recursive-rejection acceptance;
               ``grow_tree``: best-first growth within a node budget); a chain is a one-branch tree;
- ``context``: the context window: the last C committed positions, their rows and validity;
- ``tau``:     τ, the acceptance length: committed tokens per verify round, prefill excluded;
- ``suffix`` / ``corpus``: the per-request suffix index and the opt-in cross-request corpus;
- ``chooser``: the calibrated choice of who drafts (lookup / DLite / DLite's prefix continued);
- ``hybrid``:  the served hybrid drafting, as chains for a batch and as token trees;
- ``budget``:  how much to speculate: under load, whether to draft, how wide to verify;
- ``online`` / ``online_config``: online learning from verify results.
"""

from sglang_dlite.drafting.accept import chain_rejection_sample, greedy_accept, greedy_accept_length  # noqa: F401
from sglang_dlite.drafting.context import context_positions, last_rows, last_rows_of_segments  # noqa: F401
from sglang_dlite.drafting.tau import tau_of_requests, tau_of_rounds  # noqa: F401
