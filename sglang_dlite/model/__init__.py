"""The DLite drafter network and its checkpoint format, pure torch (imports no sglang): the
config (``config``, ``drafter_config``, ``targets``), the network (``dlite``, ``layers``), its
answer (``proposal``), losses, the checkpoint reader/writer and target binding (``checkpoint``)
and the bundled default target (``bundled_target``)."""
