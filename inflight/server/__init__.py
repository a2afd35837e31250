"""The HTTP server and the `inflight` command line."""
