"""Test topic: the pure decision core (orchestrator/). Its hypothesis settings live in
profiles.py and are applied per test, so other parts' suites keep their own settings."""
