"""Tests of the operator surface: the status page in a real browser, the CLI verbs, the HTTP
API's answers to bad input, and the metrics."""
