"""The engine: decides and drives what the adapters do, one durable step at a time.

The migration engine and its phase actions, the reconciler, the cleanup worker, the lease
renewer, the placement state (the one owner of custom_config.json commits) and the operator
facade the surface talks to. Decisions come from `orchestrator`; I/O goes through the
adapters (`monitord.local`, `monitord.remote`, `monitord.store`).
"""
