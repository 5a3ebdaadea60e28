"""Who may say what on the bus: one NATS user per role, allowed only its own subjects.

With one shared credential (or none), anything that reaches NATS can act as any process: a
decode worker's credentials could send prefill requests, empty every cache on the admin
subjects, or read every token stream on the gateway inboxes. Per-role users close that: the
server refuses a publish or subscribe outside the role's list (a "permissions violation").

The lists follow the flow in ``pdserve.shared.bus.protocol`` (``Subjects`` names them):

============  ===========================================  =======================================
role          publishes                                    subscribes
============  ===========================================  =======================================
gateway       prefill.*, decode.*, lease.*, cancel,        gw.> (its inbox), load.>, kv.>,
              ping.*, admin.*, admin.*.lora (requests);    _INBOX.> (replies to its requests)
              JetStream API and $KV of its responses
              bucket only
prefill       gw.> (results), load.prefill.*, kv.*          prefill.*, lease.*, cancel, ping.*,
                                                           admin.*, admin.*.lora, probe.*,
                                                           status.*, $SRV.>
decode        gw.> (tokens), load.decode.*, kv.*,          decode.*, cancel, load.prefill.*,
              lease.* (release after a pull)               ping.*, admin.*, admin.*.lora,
                                                           probe.*, status.*, $SRV.>
control       everything under the namespace, _INBOX.>     the same (pdserve rollout, doctor, the
                                                           launcher's control channel)
============  ===========================================  =======================================

Workers answer requests (ping, admin, probe, NATS micro's status and ``$SRV``) through
``allow_responses``: they may publish to a request's reply subject once, and nowhere else in
``_INBOX``. ``authorization_block`` writes this as nats-server configuration.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

ROLES = ("gateway", "prefill", "decode", "control")


def responses_bucket(namespace: str) -> str:
    """The gateway's JetStream KV bucket of stored responses (letters, digits, - and _)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", namespace) + "_responses"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def _jetstream_kv(namespace: str) -> tuple[str, ...]:
    """The JetStream API subjects a gateway needs for its bucket (stream ``KV_<bucket>``):
    create/update/info it, read keys (direct get and message get), put and delete."""
    stream = f"KV_{responses_bucket(namespace)}"
    return (
        "$JS.API.INFO",
        f"$JS.API.STREAM.*.{stream}",
        f"$JS.API.STREAM.MSG.*.{stream}",  # GET, DELETE
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.*.{stream}",
        f"$JS.API.CONSUMER.*.{stream}.>",
        f"$KV.{responses_bucket(namespace)}.>",
    )


def permissions(namespace: str, role: str) -> Permissions:
    ns = namespace
    if role == "gateway":
        return Permissions(
            publish=(
                f"{ns}.prefill.*",
                f"{ns}.decode.*",
                f"{ns}.lease.*",
                f"{ns}.cancel",
                f"{ns}.ping.*",
                f"{ns}.admin.*",
                f"{ns}.admin.*.lora",  # LoRA adapters loaded/unloaded (discovery/lora_admin.py)
                *_jetstream_kv(ns),
            ),
            subscribe=(f"{ns}.gw.>", f"{ns}.load.>", f"{ns}.kv.>", "_INBOX.>"),
        )
    worker_subscribes = (
        f"{ns}.cancel",
        f"{ns}.ping.*",
        f"{ns}.admin.*",
        f"{ns}.admin.*.lora",
        f"{ns}.probe.*",
        f"{ns}.status.*",
        "$SRV.>",  # NATS micro's discovery (PING, INFO, STATS)
    )
    if role == "prefill":
        return Permissions(
            publish=(f"{ns}.gw.>", f"{ns}.load.prefill.*", f"{ns}.kv.*"),
            subscribe=(f"{ns}.prefill.*", f"{ns}.lease.*", *worker_subscribes),
            allow_responses=True,
        )
    if role == "decode":
        return Permissions(
            publish=(f"{ns}.gw.>", f"{ns}.load.decode.*", f"{ns}.kv.*", f"{ns}.lease.*"),
            subscribe=(f"{ns}.decode.*", f"{ns}.load.prefill.*", *worker_subscribes),
            allow_responses=True,
        )
    if role == "control":
        return Permissions(
            publish=(f"{ns}.>", "_INBOX.>", "$SRV.>"),
            subscribe=(f"{ns}.>", "_INBOX.>"),
            allow_responses=True,
        )
    raise ValueError(f"unknown bus role {role!r} (one of {', '.join(ROLES)})")


def new_passwords() -> dict[str, str]:
    """A random password per role (``pdserve up`` makes new ones every run)."""
    return {role: secrets.token_urlsafe(24) for role in ROLES}


def _strings(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def authorization_block(namespace: str, passwords: dict[str, str]) -> str:
    """nats-server configuration: one user per role in ``passwords`` (the user is the role's
    name), with its permissions. A password may be a literal or a ``$VARIABLE`` reference,
    which nats-server resolves from its environment (compose and Kubernetes do that)."""
    lines = ["authorization {", "  users = ["]
    for role, password in passwords.items():
        perms = permissions(namespace, role)
        secret = password if password.startswith("$") else json.dumps(password)
        lines += [
            f"    {{user: {json.dumps(role)}, password: {secret}, permissions: {{",
            f"      publish: {{allow: {_strings(perms.publish)}}}",
            f"      subscribe: {{allow: {_strings(perms.subscribe)}}}",
        ]
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
