"""``pdserve doctor``: checks the KV path (UCX transports, pull against raw bandwidth, a running
stack). A tool of its own, never on a request's path."""
