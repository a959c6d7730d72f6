"""Durable state on the PBX: the SQLite state database (transactions, generations, events,
cleanup queue, wishes), the spool files (`custom_config.json`, `remote_state.json`) and
the owner id. An adapter: it knows nothing of the engine. The supervisor's per-area daemon
records are not here: they are files under `{work_dir}/supervisor/records/`, written by
monitord.local.supervisor."""
