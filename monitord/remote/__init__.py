"""Everything that crosses the SSH connection to the VPS: the tunnel keeper and its
forwards, remote command execution, the agent client, provisioning of monitord.pyz,
preflight checks and the data copy. An adapter: it knows nothing of the engine."""
