"""The PBX side's own processes: the supervisor that starts, adopts and fences local
messenger daemons. An adapter: it knows nothing of the engine or of the VPS."""
