"""Real components that tests start and stop: an OpenSSH sshd, run-time SSH keys and a
fault-injecting TCP proxy. Shared by the tunnel, provisioning and fault tests."""
