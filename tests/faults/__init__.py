"""Fault tests: the disk, hostile clients and secrets at rest (issue 14)."""
