"""The floor every room stands on: configuration, logging, metrics, crash-safe files,
process identity and the singleton lock. The VPS side may use the primitives here
(atomic_file, proc_identity, singleton, logs) but never `config` or `metrics`."""
