"""The KV path: cache layout, block hashes, UCX configuration and progress, the transfer itself,
and the probe messages the doctor sends through it."""
