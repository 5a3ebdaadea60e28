"""The gateway's edge options: who may call what (admin and metrics keys beside ``--api-key``),
how much one key may use, and how much the HTTP parser accepts and waits for.

They live apart from config.py (which had no room left) as a base class of ``GatewayConfig``,
so they are its fields, flags and ``PDSERVE_*`` variables like any other; ``check_edge`` holds
their rules, called from ``GatewayConfig.__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.errors import StartupError
from pdserve.shared.options import opt


@dataclass
class GatewayEdgeOptions:
    admin_api_key: list[str] = opt(
        [],
        "key for the admin endpoints (/reset_prefix_cache); repeat for several (env: comma "
        "separated); an --api-key gets 403 there, and with --api-key set and no admin key "
        "they are closed",
        multiple=True,
    )
    metrics_api_key: list[str] = opt(
        [],
        "key that /metrics then requires (an admin key works too); repeat for several; "
        "default: /metrics is open",
        multiple=True,
    )
    max_concurrent_requests_per_key: int = opt(
        0, "generation requests one API key may have in flight (429 beyond); 0 = no limit"
    )
    tokens_per_minute_per_key: int = opt(
        0,
        "prompt + completion tokens one API key may use in any 60 s (a sliding window; 429 "
        "with Retry-After once spent); 0 = no limit",
    )
    http_max_line_size: int = opt(8190, "longest HTTP request line, bytes (400 beyond)")
    http_max_field_size: int = opt(8190, "longest HTTP header line, bytes (400 beyond)")
    http_max_headers: int = opt(100, "most HTTP headers in one request (400 beyond)")
    http_keepalive_timeout: float = opt(
        75.0,
        "seconds a connection may stay idle, and the longest a client may take to send a "
        "request's headers (counted from the connection's start or its previous answer)",
    )
    http_body_timeout: float = opt(
        60.0, "seconds a client has to send a request's body once its headers are in (408)"
    )


def check_edge(cfg: GatewayEdgeOptions) -> None:
    """Refuse edge options that cannot work, before the gateway starts."""
    for name in ("max_concurrent_requests_per_key", "tokens_per_minute_per_key"):
        if getattr(cfg, name) < 0:
            flag = "--" + name.replace("_", "-")
            raise StartupError(f"{flag} must be >= 0 (0 = no limit), got {getattr(cfg, name)}")
    for name, least in (("http_max_line_size", 256), ("http_max_field_size", 256)):
        if getattr(cfg, name) < least:
            flag = "--" + name.replace("_", "-")
            raise StartupError(f"{flag} must be at least {least}, got {getattr(cfg, name)}")
    if cfg.http_max_headers < 8:  # clients always send a few (Host, Content-Type, ...)
        raise StartupError(f"--http-max-headers must be at least 8, got {cfg.http_max_headers}")
    for name in ("http_keepalive_timeout", "http_body_timeout"):
        if getattr(cfg, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise StartupError(f"{flag} must be > 0 seconds, got {getattr(cfg, name)}")
