"""`pdserve bench`: datasets, arrivals, streaming client, metrics and reports."""
