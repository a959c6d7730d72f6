"""Test doubles real enough to ship: the in-process SSH "VPS" of the demo and the tests."""
