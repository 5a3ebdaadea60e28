"""What the gateway's HTTP handlers share (the aiohttp app's state, ``GATEWAY_KEY``): the served
model, the admission of requests by x-request-id, and the ``Gateway`` object holding them with the
bus side, router and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from pdserve.gateway.api_models import GenerationParams
from pdserve.gateway.errors import APIError, overloaded
from pdserve.gateway.inflight.dispatcher import Dispatcher
from pdserve.gateway.key_limits import KeyLimits
from pdserve.gateway.router import Router
from pdserve.gateway.tokenizer import ChatTemplate, ModelTokenizer
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.rejects import BusRejectCollector
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.sampling import SamplingParams
from pdserve.shared.telemetry.metrics import GatewayMetrics, WorkerLoadCollector

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    chat: ChatTemplate | None
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(cls, engine: EngineConfig) -> ServedModel:
        # Imported only here, and light: the same resolution as the workers', so the name the
        # gateway serves is the name the workers register (a GGUF converts without torch; only
        # the demo model's first creation needs it).
        from pdserve.shared.models.resolve import resolve

        model = resolve(engine.model)
        model_dir = model.path
        tok = ModelTokenizer.from_dir(model_dir)
        chat = None
        if tok.chat_template is not None:
            chat = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        return cls(
            name=engine.served_model_name or model.name,
            tokenizer=tok,
            chat=chat,
            max_model_len=engine.max_model_len or _context_length(model_dir),
        )


def _context_length(model_dir: Path) -> int:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and value > 0 else 2048


def new_gateway_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"gw-{host}-{os.getpid()}-{secrets.token_hex(3)}"


# ----------------------------------------------------------------------------- admission


class Admissions:
    """The HTTP generation requests admitted and not yet answered, by the client's x-request-id
    (on the bus each travels under ids of its own, one per prompt of a prompt array: see
    ``gateway/inflight/``). ``admit`` is the one way in and out."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self._gauge = gauge
        self._ids: set[str] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self._ids)

    @contextlib.contextmanager
    def admit(self, client_id: str) -> Iterator[None]:
        """Hold ``client_id`` admitted for the block; refuse a duplicate id (409) or a full
        gateway (503, ``overloaded``)."""
        if client_id in self._ids:
            raise APIError(
                409,
                f"a request with x-request-id {client_id} is already in flight",
                param="x-request-id",
                code="duplicate_request_id",
            )
        if len(self._ids) >= self.limit:
            raise overloaded(
                f"the gateway has {len(self._ids)} requests in flight", retry_after=1.0
            )
        self._ids.add(client_id)
        self.idle.clear()
        self._gauge.inc()
        try:
            yield
        finally:
            self._ids.discard(client_id)
            self._gauge.dec()
            if not self._ids:
                self.idle.set()


class Gateway:
    """Everything the handlers share: config, model, bus side, metrics."""

    def __init__(
        self,
        config: GatewayConfig,
        engine: EngineConfig,
        bus_config: BusConfig,
        gateway_id: str | None = None,
        bus: Bus | None = None,  # default: NATS as bus_config says
    ) -> None:
        self.config = config
        self.bus_config = bus_config
        self.gateway_id = gateway_id or new_gateway_id()
        self.model = ServedModel.load(engine)
        self.block_size = engine.block_size
        self.scheduling_policy = engine.scheduling_policy  # the workers': priority needs it
        self.metrics_registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.metrics_registry)
        self.bus = bus if bus is not None else Bus(bus_config, self.gateway_id)
        self.workers = WorkerRegistry(self.bus, config.worker_timeout)
        self.metrics_registry.register(WorkerLoadCollector(self.workers.loads))
        self.metrics_registry.register(BusRejectCollector(lambda: self.bus.stats.rejected_by))
        self.router = Router(
            routable=self.workers.routable,
            block_size=engine.block_size,
            model=self.model.name,
            cached_hits=self.workers.prefix_hits,
            cached_tiers=self.workers.tier_chain,
            prefill_policy=config.prefill_routing,
        )
        self.dispatcher = Dispatcher(
            self.bus,
            self.workers,
            self.router,
            self.gateway_id,
            config.request_timeout,
            config.prefill_timeout,
            config.max_migrations,
            self.metrics.migrations,
            first_token_timeout=config.first_token_timeout,
            stall_timeout=config.stall_timeout,
        )
        self.admissions = Admissions(config.max_queue, self.metrics.in_flight)
        self.key_limits = KeyLimits(
            config.max_concurrent_requests_per_key,
            config.tokens_per_minute_per_key,
            self.metrics_registry,
        )
        # adapters unloaded through POST /v1/unload_lora_adapter that some worker's report
        # still lists (a beat sent before the unload): hidden at once (gateway/lora_admin.py)
        self.unloaded_loras: set[str] = set()

    @property
    def admitted_count(self) -> int:
        """The HTTP requests admitted and not yet answered (one may be several on the bus)."""
        return len(self.admissions)

    @property
    def idle(self) -> asyncio.Event:
        """Set while no request is in flight (a draining gateway waits for it)."""
        return self.admissions.idle

    async def start(self) -> None:
        await self.bus.connect()
        await self.workers.start()
        await self.dispatcher.start()
        log.info("gateway %s serving %s", self.gateway_id, self.model.name)

    async def stop(self) -> None:
        await self.workers.stop()
        await self.dispatcher.close()
        await self.bus.close()

    def healthy(self) -> tuple[bool, str]:
        if not self.bus.connected:
            return False, "not connected to NATS"
        if not self.router.has_decode():
            others = {w.model for w in self.workers.loads("decode") if w.model != self.model.name}
            if others:
                # A misconfigured pair (e.g. --served-model-name on one side only) must be obvious.
                return False, f"decode workers serve {sorted(others)}, not {self.model.name!r}"
            return False, "no decode worker is alive"
        return True, "ok"

    def advertised_loras(self) -> set[str]:
        """The LoRA adapters the decode workers advertise (``--lora-modules`` or loaded at run
        time; a decode worker can also prefill, so it alone can serve one)."""
        return {a for w in self.router.serving("decode") for a in w.lora_adapters}

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters served as models of their own: those advertised, less those just
        unloaded (forgotten here once no worker lists them any more)."""
        advertised = self.advertised_loras()
        self.unloaded_loras &= advertised
        return sorted(advertised - self.unloaded_loras)

    def lora_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names, None for the base model."""
        return None if model == self.model.name else model

    def context_limit(self) -> int:
        """Longest prompt + output that can be served: the model's context, or less when even
        the largest decode worker's whole KV cache cannot hold that many tokens."""
        capacities = [
            w.total_blocks * w.block_size
            for w in self.router.serving("decode")
            if w.block_size > 0 and w.total_blocks > 0
        ]
        if not capacities:
            return self.model.max_model_len
        return min(self.model.max_model_len, max(capacities))

    def sampling_params(
        self, p: GenerationParams, max_tokens: int, cache_salt: str | None = None
    ) -> SamplingParams:
        """The engine's parameters for one prompt of the request ``p``; ``cache_salt``: the
        digest its blocks are hashed under (``tenancy.request_salt``)."""
        eos = [] if p.ignore_eos else list(self.model.tokenizer.eos_token_ids)
        stop_ids = list(dict.fromkeys(eos + p.stop_token_ids))
        logprobs = p.logprobs
        if logprobs is None and p.best_of is not None and p.best_of > p.n:
            logprobs = 0  # best_of ranks choices by their tokens' log-probs
        bias = p.logit_bias
        return SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            ignore_eos=p.ignore_eos,
            # max_tokens 0 generates nothing: the choices would all be the same empty one
            n=1 if max_tokens == 0 else max(p.n, p.best_of or 1),
            logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(p),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            min_tokens=min(p.min_tokens, max_tokens),
            logit_bias_token_ids=list(bias),
            logit_bias_values=[float(v) for v in bias.values()],
            guided=p.guided,
            speculate=p.speculate,
            priority=p.priority,
            cache_salt=cache_salt,
        )


def _prompt_logprobs(p: GenerationParams) -> int | None:
    """Alternatives per prompt token the engine computes: for echo's log-probs and for vLLM's
    prompt_logprobs, the more of the two (each response field keeps its own count)."""
    asked = [k for k in (p.logprobs if p.echo else None, p.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


GATEWAY_KEY = web.AppKey("gateway", Gateway)
CLIENT_ID_KEY = web.RequestKey("bus_id", str)
ARRIVED_KEY = web.RequestKey("arrived", float)  # time.monotonic() when the request came in
