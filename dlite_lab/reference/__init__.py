"""The reference engine (HF transformers, one request at a time: the correctness oracle and the CPU
acceptance engine) and the per-request drafter adapters it drives."""
