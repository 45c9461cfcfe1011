"""Workloads (conversations in one JSON-lines format) and their replay; filled in below."""
