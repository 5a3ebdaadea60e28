"""Telemetry: OpenTelemetry tracing and Prometheus metrics (``pdserve trace``, which reads the traces
back from Jaeger, is a command: services/control/trace_cli.py)."""
