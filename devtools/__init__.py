"""Development tools beside the package: synthetic checkpoints, a daemon under a NOTIFY_SOCKET
listener, the demo. Not installed."""
