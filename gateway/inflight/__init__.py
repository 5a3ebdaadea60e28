"""The gateway's side of one request in flight on the bus (lifecycle: ``dispatcher.py``)."""
