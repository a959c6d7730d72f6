"""Tests of the local supervisor, the fake messenger daemon and the split-brain detector."""
