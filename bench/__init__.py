"""The benchmark harness (not part of the test suite)."""
