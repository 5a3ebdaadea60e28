"""``pdserve rollout --model NEW``: swap the model of a running ``pdserve up`` with no downtime.

The launcher's supervision loop calls ``RolloutDriver.poll`` every 0.2 s; a rollout is a small
state machine advanced by those calls (nothing here blocks the loop but a rollback's stops):

1. **load**: for every worker now serving, a worker of the same role starts with ``--model NEW``
   and ``--standby`` (services/standby.py) on the same CPUs/GPU, under the gateway's served name
   (the gateway holds one name and tokenizer), announcing its ``model_version``;
2. **verify**: once all have registered, services/control/version_probe.py sends each a probe through
   the real prefill -> KV pull -> decode path and checks the answer;
3. **switch**: SIGUSR1 promotes every new worker; once the gateway's /v1/models lists the new
   version, the old workers get SIGTERM - prefill first: a draining prefill worker takes no new
   prompt and serves the KV pulls it leased, which only an old decode worker can take (the
   version is in the KV layout), so those keep serving until the old prefill workers are gone;
4. **drain**: then the old decode workers get SIGTERM: they take no new legs and finish (or
   migrate) their streams, then exit;
5. **done** when the old ones have exited: the answer names both versions and the phase times.

A worker that dies while loading, a registration that never comes, or a failed probe rolls back:
the new workers are stopped (standby: nothing was routed to them) and the old keep serving; the
answer says why, and ``pdserve rollout`` exits 1.

Not yet: a rollout beside ``--autoscale`` (the planner would scale the versions apart) and
aggregated stacks (``--prefill-workers 0``: the probe needs a prefill worker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import time
import urllib.request
from typing import Any

from pdserve.services.control import version_probe
from pdserve.services.control.channel import ControlListener, ControlRequest
from pdserve.services.control.launch_checks import keyed_request, registered_names, user_key
from pdserve.services.control.processes import Child
from pdserve.services.standby import PROMOTE_SIGNAL, derive_version

LOAD_TIMEOUT = 600.0  # as pdserve up waits for its first workers
SWITCH_TIMEOUT = 10.0  # promoted workers reach the gateway's table within a heartbeat or two
KILL_AFTER_DRAIN = 30.0


def models_card(gateway_url: str, key: str | None) -> dict[str, Any]:
    request = keyed_request(gateway_url + "/v1/models", key)
    with urllib.request.urlopen(request, timeout=5.0) as resp:
        return json.loads(resp.read())["data"][0]


class RolloutFailed(Exception):
    pass


class Rollout:
    def __init__(self, fleet: Any, body: dict[str, Any], gateway_url: str) -> None:
        self.fleet, self.url, self.t0 = fleet, gateway_url, time.monotonic()
        self.times: dict[str, float] = {}
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RolloutFailed('"model" is required')
        if fleet.autoscaler is not None:
            raise RolloutFailed("a rollout beside --autoscale is not supported yet")
        card = models_card(gateway_url, user_key(fleet.gateway))
        served = body.get("served_model_name") or card["id"]
        if served != card["id"]:
            raise RolloutFailed(
                f"the gateway serves {card['id']!r} with its tokenizer: another served name "
                "needs a pdserve up restart"
            )
        self.version = str(body.get("model_version") or derive_version(model))[:128]
        self.old_versions = list(card.get("model_versions", []))
        if self.version in self.old_versions:
            raise RolloutFailed(f"version {self.version} serves already (--model-version)")
        self.old = {n: c for n, c in self._alive().items()}
        roles = [fleet.started[n].role for n in self.old]
        if "prefill" not in roles or "decode" not in roles:
            raise RolloutFailed("a rollout needs prefill and decode workers (not aggregated)")
        self.expect = [int(t) for t in body.get("expect") or []]
        # the version too: a worker started later (a restart) joins this version's KV layout
        self.common = {
            **fleet.common,
            "model": model,
            "served_model_name": served,
            "model_version": self.version,
        }
        self.new: dict[str, Child] = {}
        for name in self.old:  # same roles and places as the old
            start = fleet.started[name]
            child = fleet._start_worker(
                start.role,
                fleet.next_index[start.role],
                self.common,
                start.place,
                standby=True,
                version=self.version,
            )
            self.new[child.name] = child
        self.phase, self.deadline = "load", time.monotonic() + LOAD_TIMEOUT
        self.probe: concurrent.futures.Future | None = None
        self.retiring: set[int] = set()  # pids
        self.say(f"{', '.join(self.new)} loading {model} as version {self.version}")

    def say(self, text: str) -> None:
        print(f"pdserve rollout: {text}", flush=True)

    def _alive(self) -> dict[str, Child]:
        return {
            c.name: c for c in self.fleet.children if c.name in self.fleet.started and c.alive()
        }

    def _mark(self, phase: str) -> None:
        self.times[phase] = round(time.monotonic() - self.t0, 3)

    def poll(self) -> dict[str, Any] | None:
        """Advance; the answer once done or rolled back, else None."""
        try:
            return getattr(self, f"_{self.phase}")()
        except RolloutFailed as exc:
            return self.roll_back(str(exc))
        except Exception as exc:  # noqa: BLE001 - whatever broke, the old version keeps serving
            return self.roll_back(f"{type(exc).__name__}: {exc}")

    def _load(self) -> None:
        for name, child in self.new.items():
            if not child.alive():
                raise RolloutFailed(f"{name} exited with {child.popen.returncode} while loading")
        if time.monotonic() > self.deadline:
            raise RolloutFailed(f"the new workers did not register in {LOAD_TIMEOUT:.0f} s")
        if set(self.new) <= registered_names(self.url, self.fleet.metrics_key):
            self._mark("loaded")
            role = {n: self.fleet.started[n].role for n in self.new}
            bus = dataclasses.replace(self.fleet.bus, nats_url=str(self.fleet.common["nats_url"]))
            check = version_probe.verify(
                bus,
                [n for n in self.new if role[n] == "prefill"],
                [n for n in self.new if role[n] == "decode"],
                expect=self.expect,
            )
            pool = concurrent.futures.ThreadPoolExecutor(1, "rollout-probe")
            self.probe = pool.submit(asyncio.run, check)
            pool.shutdown(wait=False)
            self.phase = "verify"

    def _verify(self) -> None:
        assert self.probe is not None
        if not self.probe.done():
            return
        result = self.probe.result()
        if not result.ok:
            raise RolloutFailed(f"verification failed: {result.detail}")
        self.probed = result.detail
        self._mark("verified")
        for child in self.new.values():
            child.signal(PROMOTE_SIGNAL)
        self.say(f"verified ({result.detail}); promoted {', '.join(self.new)}")
        self.phase, self.deadline = "switch", time.monotonic() + SWITCH_TIMEOUT

    def _switch(self) -> None:
        if self.version not in models_card(self.url, user_key(self.fleet.gateway)).get(
            "model_versions", []
        ):
            if time.monotonic() < self.deadline:
                return
            self.say(f"the gateway does not list {self.version} yet: draining the old anyway")
        self._mark("switched")
        self._retire("prefill")
        self.say(f"routing to {self.version}; draining {', '.join(self._old_of('prefill'))}")
        self.phase = "retire_prefill"

    def _retire_prefill(self) -> None:
        # A leg whose prompt an old prefill worker computed is pulled by an old decode worker
        # (a new one would refuse the layout, and a failed pull fails the request): the old
        # decode workers keep serving until no old prefill worker holds a lease.
        if self._wait_out("prefill"):
            return
        self._retire("decode")
        self.say(f"draining {', '.join(self._old_of('decode'))}")
        self.phase = "drain"

    def _drain(self) -> dict[str, Any] | None:
        if self._wait_out("decode"):
            return None
        codes = {name: self._forget(child) for name, child in self.old.items()}
        self.fleet.common = self.common  # later workers (a restart, the next rollout) are new
        self._mark("drained")
        self.say(f"done: {self.version} serves; old workers exited {codes}")
        return {
            "ok": True,
            "version": self.version,
            "old_versions": self.old_versions,
            "workers": list(self.new),
            "exited": codes,
            "probe": self.probed,
            "seconds": self.times,
        }

    def _old_of(self, role: str) -> list[str]:
        return [n for n in self.old if self.fleet.started[n].role == role]

    def _retire(self, role: str) -> None:
        """SIGTERM the old workers of ``role``: each drains, then exits."""
        for name in self._old_of(role):
            self.old[name].signal(signal.SIGTERM)
            self.retiring.add(self.old[name].pid)
        self.deadline = time.monotonic() + self.fleet.worker.drain_seconds + KILL_AFTER_DRAIN

    def _wait_out(self, role: str) -> bool:
        """Whether an old worker of ``role`` still drains (killed past the deadline)."""
        left = [self.old[n] for n in self._old_of(role) if self.old[n].alive()]
        if left and time.monotonic() > self.deadline:
            for child in left:
                self.say(f"{child.name} is still draining past its deadline: killed")
                child.signal(signal.SIGKILL)
        return bool(left)

    def roll_back(self, reason: str) -> dict[str, Any]:
        self.say(f"rolling back: {reason}")
        for child in self.new.values():
            self.retiring.add(child.pid)
            child.signal(signal.SIGTERM)  # standby: no request to finish
        for child in self.new.values():
            self._forget(child, 10.0)
        return {"ok": False, "error": reason, "rolled_back": True, "serving": self.old_versions}

    def _forget(self, child: Child, timeout: float = 0.0) -> int:
        code = child.stop(timeout)
        self.fleet.started.pop(child.name, None)
        if child in self.fleet.children:
            self.fleet.children.remove(child)
        return code


class RolloutDriver:
    """Takes control requests off the listener and runs one rollout at a time."""

    def __init__(self, fleet: Any, gateway_url: str) -> None:
        self.fleet, self.url = fleet, gateway_url
        bus = dataclasses.replace(fleet.bus, nats_url=str(fleet.common["nats_url"]))
        self.listener = ControlListener(bus)
        self.current: tuple[Rollout, ControlRequest] | None = None
        self.retiring: set[int] = set()  # pids

    def start(self) -> None:
        """Listen; a NATS that refuses us costs ``pdserve rollout`` only, not serving."""
        try:
            self.listener.start()
        except Exception as exc:  # noqa: BLE001
            print(
                f"pdserve: no control channel, pdserve rollout cannot reach us ({exc})", flush=True
            )

    def retired(self, child: Child) -> bool:
        """Whether a rollout stopped this child (its exit is no crash)."""
        return child.pid in self.retiring

    def poll(self) -> None:
        if self.current is not None:
            rollout, req = self.current
            answer = rollout.poll()
            self.retiring |= rollout.retiring
            if answer is not None:
                self.current = None
                req.reply(answer)
        while (req := self.listener.get()) is not None:
            if req.body.get("op") != "rollout":
                req.reply({"ok": False, "error": f"unknown op {req.body.get('op')!r}"})
            elif self.current is not None:
                req.reply({"ok": False, "error": "a rollout is in progress"})
            else:
                try:
                    self.current = (Rollout(self.fleet, req.body, self.url), req)
                except (RolloutFailed, OSError, ValueError, KeyError) as exc:
                    req.reply({"ok": False, "error": str(exc), "rolled_back": False})

    def close(self) -> None:
        if self.current is not None:  # pdserve up stops: the caller must not wait for nothing
            self.current[1].reply({"ok": False, "error": "pdserve up is stopping"})
            self.current = None
        self.listener.close()
