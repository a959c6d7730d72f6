"""Real components that tests start and stop: `monitord run` as a subprocess (daemon_process),
an OpenSSH sshd, run-time SSH keys and a fault-injecting TCP proxy. Shared by the lifecycle,
tunnel, provisioning and fault tests."""
