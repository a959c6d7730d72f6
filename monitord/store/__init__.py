"""Durable state on the PBX: the SQLite state database (transactions, events, cleanup
queue, daemon records), the spool files (`custom_config.json`, `remote_state.json`) and
the owner id. An adapter: it knows nothing of the engine."""
