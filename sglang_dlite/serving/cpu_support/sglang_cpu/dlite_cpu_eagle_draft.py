"""CPU-ONLY, TEST-ONLY: sglang's own EAGLE / EAGLE3 draft worker on the ``torch_native`` attention
backend, for chains (``--speculative-eagle-topk 1``).

sglang 0.5.23's ``DraftBackendFactory`` maps the draft model's multi-step decode backend and its
draft-extend backend for GPU backends and ``intel_amx`` only; ``intel_amx`` needs sgl_kernel's CPU
build (``decode_attention_cpu``, ``extend_attention_cpu``, ``build_draft_decode_metadata_cpu``),
which is not on PyPI, and ``torch_native`` stops the launch with "EAGLE is not supported in decode
attention backend torch_native". This adds ``torch_native`` to both maps:

- draft decode: one ``TorchNativeAttnBackend`` per draft step after the first, as
  ``IntelAMXMultiStepDraftBackend`` builds them; with one candidate per step (topk 1, page size 1)
  sglang writes a chain's draft tokens into ``req_to_token[req, seq_len : seq_len + steps]``
  (``assign_draft_cache_locs``), so draft step s attends to ``req_to_token[req, : seq_len + s + 1]``:
  the backend's own decode attention with ``seq_lens + s + 1`` (what ``build_draft_decode_metadata``
  computes for topk 1). Token trees (topk > 1) are refused with a message.
- draft extend: the ``TorchNativeAttnBackend`` itself (its extend path reads the forward batch's
  ``extend_prefix_lens`` / ``extend_seq_lens``).

Installed lazily (on first import of ``draft_utils``) by ``sitecustomize``; never used on a CUDA
deployment. Lets ``bench/e2e.py --modes eagle3`` run sglang's EAGLE3 beside DLITE on this CPU.
"""

TARGET_MODULE = "sglang.srt.speculative.draft_utils"


class TorchNativeMultiStepDraftBackend:
    """``speculative_num_steps - 1`` torch_native backends, one per draft decode step."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk != 1:
            raise NotImplementedError(
                "sglang's EAGLE draft on the CPU torch_native backend (sglang-dlite's stand-in) drafts "
                f"chains only: pass --speculative-eagle-topk 1 (got {topk}); token trees need sgl_kernel's "
                "CPU build (--attention-backend intel_amx).")
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.attn_backends = [_DraftStepBackend(model_runner, step) for step in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)
            backend.step_seq_lens = forward_batch.seq_lens + backend.step + 1

    def init_cuda_graph_state(self, *args, **kwargs) -> None:  # no graphs on a CPU
        return None


def _DraftStepBackend(model_runner, step: int):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DraftStepBackend(TorchNativeAttnBackend):
        """Draft decode step ``step``: the context is the committed prefix + drafts 0..step."""

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            seq_lens = forward_batch.seq_lens
            forward_batch.seq_lens = self.step_seq_lens
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = seq_lens

    b = DraftStepBackend(model_runner)
    b.step, b.step_seq_lens = step, None
    return b


def patch(module) -> None:
    cls = module.DraftBackendFactory
    if getattr(cls, "_dlite_torch_native_patched", False):
        return
    orig = cls._create_backend

    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        if "torch_native" not in backend_map:
            backend_map = dict(backend_map)
            if backend_name == "decode_attention_backend" and stamps_children:
                backend_map["torch_native"] = lambda: ("torch_native", TorchNativeMultiStepDraftBackend(
                    self.draft_model_runner, self.topk, self.speculative_num_steps))
            else:
                from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

                backend_map["torch_native"] = lambda: ("torch_native", TorchNativeAttnBackend(self.draft_model_runner))
        return orig(self, backend_name, backend_map, error_template, stamps_children)

    cls._create_backend = _create_backend
    cls._dlite_torch_native_patched = True


def install_lazy() -> None:
    from post_import import on_import

    on_import(TARGET_MODULE, patch)
