"""The operator's side of monitord: what a person or another tool touches.

The `monitord` command line (cli, client_commands, launcher, demo), the daemon's lifecycle
(daemon: serve → startup → main loop → shutdown, admission, sd_notify), the HTTP API and
status views (http_api, status_api, status_view, bundle), and `wiring`, the one place where
the runtime's components are built and connected.

May import the engine and everything below it; nothing below imports this package.
"""
