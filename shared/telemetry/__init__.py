"""Telemetry: OpenTelemetry tracing, Prometheus metrics, and ``pdserve trace`` over Jaeger."""
