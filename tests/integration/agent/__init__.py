"""Tests of the remote agent: its API, area leases, self-fencing and single instance."""
