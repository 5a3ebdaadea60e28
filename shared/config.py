"""One source of truth for configuration.

Every option is a dataclass field. The CLI flag is ``--field-name`` and the environment
variable is ``PDSERVE_FIELD_NAME``; a flag beats the variable, which beats the default (the
machinery: ``pdserve.shared.options``). OpenTelemetry is configured only
through the standard ``OTEL_*`` variables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.shared.errors import StartupError
from pdserve.shared.execution_options import ExecutionOptions
from pdserve.shared.gateway_edge_options import GatewayEdgeOptions, check_edge
from pdserve.shared.lora_options import LoraOptions
from pdserve.shared.options import opt
from pdserve.shared.scheduling_options import SchedulingOptions
from pdserve.shared.speculative_options import SPECULATIVE_METHODS, speculative_problem

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "pythonic")  # gateway/tools/setup.PARSERS
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # gateway/reasoning.py


@dataclass
class BusConfig:
    nats_url: str = opt(
        "nats://127.0.0.1:4222",
        "NATS server URL(s), comma separated: nodes of one cluster, tried in this order (this "
        "host's own node first, the others for failover)",
    )
    namespace: str = opt("pdserve", "prefix of every NATS subject")
    nats_token: str | None = opt(None, "NATS auth token")
    nats_user: str | None = opt(None, "NATS user name")
    nats_password: str | None = opt(None, "NATS password")
    nats_creds: str | None = opt(None, "path to a NATS .creds file")
    nats_tls_ca: str | None = opt(None, "CA bundle used to verify the NATS server (enables TLS)")
    nats_tls_cert: str | None = opt(None, "client certificate for NATS mutual TLS")
    nats_tls_key: str | None = opt(None, "client key for NATS mutual TLS")
    max_message_bytes: int = opt(8 * 1024 * 1024, "largest bus message accepted")


@dataclass
class EngineConfig(SchedulingOptions, LoraOptions, ExecutionOptions):
    model: str | None = opt(
        "smollm2-135m-instruct",
        "a built-in model (smollm2-135m-instruct; demo = random weights for tests), a .gguf file "
        "or a local Hugging Face model directory",
    )
    served_model_name: str | None = opt(
        None, "model name in the API (default: the built-in name, file stem or directory name)"
    )
    # in the KV layout fingerprint when set: a rollout's workers pair only with their own version
    model_version: str = opt("", "the version this worker announces; empty = from --model's path")
    device: str = opt("auto", "auto, cpu or cuda[:N]")
    dtype: str = opt(
        "auto",
        "auto, float32, bfloat16, float16 or float64 (tests)",
        choices=("auto", "float32", "bfloat16", "float16", "float64"),
    )
    quantization: str = opt(
        "none",
        "weights: none (--dtype) or int8 (per-channel INT8 in every linear layer and the "
        "vocabulary head; CPU: dynamic per-token activations through fbgemm, CUDA: weight-only)",
        choices=("none", "int8"),
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV-cache element type: auto (--dtype), int8 or fp8_e4m3 (one float32 scale per token "
        "and KV head); prefill and decode workers must use the same",
        choices=("auto", "int8", "fp8_e4m3"),
    )
    block_size: int = opt(16, "tokens per KV-cache block")
    num_kv_blocks: int = opt(0, "KV-cache blocks; 0 sizes the cache from --kv-cache-gib")
    kv_cache_gib: float = opt(1.0, "memory for the KV cache when --num-kv-blocks is 0")
    kv_offload_ram_gib: float = opt(
        0.0,
        "host memory (pinned on CUDA) for prefix-cached KV blocks evicted from the pool: "
        "a prefix found there is loaded back, not recomputed; 0 = off",
    )
    kv_offload_disk: str | None = opt(
        None,
        "directory for the blocks host memory takes (needs --kv-offload-ram-gib), kept "
        "and found again after a restart; one worker per directory",
    )
    kv_offload_disk_gib: float = opt(16.0, "most space --kv-offload-disk's blocks take")
    max_num_seqs: int = opt(64, "most sequences running in one decode step")
    max_num_batched_tokens: int = opt(2048, "token budget of one engine step")
    max_model_len: int = opt(0, "longest prompt + output; 0 takes the model's own limit")
    prefix_cache: bool = opt(
        True, "reuse cached KV blocks of shared prompt prefixes (--no-prefix-cache turns it off)"
    )
    seed: int = opt(0, "seed for weights of the demo model and for unseeded sampling")
    tp_lm_head: str = opt(
        "vocab",
        "the LM head at TP > 1: vocab = each rank computes its slice of the vocabulary and rank 0 "
        "gathers the logits; replicated = rank 0 computes them all (perf/tp_bench.py compares)",
        choices=("vocab", "replicated"),
    )
    tensor_parallel_size: int = opt(
        1,
        "ranks (processes) one worker's model is sharded across: NCCL on CUDA (a GPU each), "
        "gloo on CPU (the worker's CPUs split between them); rank 0 speaks NATS and schedules",
    )
    speculative: str = opt(
        "off",
        "speculative decoding on decode workers: ngram = prompt lookup (drafts copied from the "
        "prompt and output so far), draft = a smaller model (--draft-model); the output is "
        "unchanged either way",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = opt(4, "most draft tokens verified per sequence and step (K)")
    ngram_min: int = opt(1, "shortest n-gram (of the last tokens) --speculative ngram matches")
    ngram_max: int = opt(4, "longest n-gram --speculative ngram matches (the longest match wins)")
    draft_model: str | None = opt(
        None, "the draft model of --speculative draft (same tokenizer as --model)"
    )
    spec_token_cost: float = opt(
        -1.0,
        "adaptive K: what one more draft token costs a sequence, relative to a plain decode "
        "step; each sequence drafts the length that emits the most tokens per cost at its "
        "acceptance rate, pausing where none pays. -1 measures it on the engine's own steps; "
        "0 = drafts are free (always K)",
    )

    def __post_init__(self) -> None:
        problem = speculative_problem(self)
        if problem is not None:
            raise StartupError(problem)
        self.check_scheduling()


@dataclass
class WorkerConfig:
    worker_id: str | None = opt(None, "unique worker name (default: role-host-pid)")
    # Both KV-transfer ends listen (the prefill side for requests, the decode side for the data),
    # through UCX's TCP transport on this address's interface only; see shared/kv/ucx_config.py.
    ucx_host: str = opt(
        "127.0.0.1",
        "this worker's address: KV transfer (UCX TCP) and /metrics listen only there; "
        "0.0.0.0 = every interface",
    )
    ucx_port: int = opt(0, "TCP port KV transfer listens on; 0 picks a free one")
    metrics_port: int = opt(0, "Prometheus /metrics port; 0 disables it")
    heartbeat_seconds: float = opt(0.5, "how often load is published")
    kv_events_zmq: str = opt("", "also publish KV events in vLLM's format on ZMQ (tcp://*:5557)")
    kv_events_zmq_format: str = opt("map", "vLLM KV event encoding", choices=("map", "array"))
    kv_events_zmq_topic: str = opt("", "the ZMQ topic of --kv-events-zmq (vLLM's default: none)")
    lease_seconds: float = opt(
        30.0, "how long a prefill worker holds KV blocks for the decode pull"
    )
    local_prefill_threshold: int = opt(
        0, "decode workers prefill prompts shorter than this locally"
    )
    kv_failure_policy: str = opt(
        "fail",
        "a failed KV pull: fail, recompute here, or reprefill (on another prefill worker)",
        choices=("fail", "recompute", "reprefill"),
    )
    kv_pull_timeout: float = opt(
        30.0,
        "decode: seconds a bulk KV pull may take, or a layer-streamed one may go without a "
        "piece, before it counts as failed (its prefill worker died or stalled) and "
        "--kv-failure-policy applies",
    )
    kv_stream_threshold: int = opt(
        -1,
        "layer-wise KV streaming: a prefill worker leases the KV of a prompt of at least this "
        "many tokens when its last forward pass starts and sends each layer group as it is "
        "written; a decode worker with 0 always pulls in bulk; 0 = off; -1 = auto: 1024 on "
        "CUDA, off on a CPU (where the pull's copying competes with prefill for the cores)",
    )
    kv_stream_layer_groups: int = opt(
        4, "decode: the pieces (groups of layers) a streamed KV pull asks for at once"
    )
    kv_checksum: bool = opt(
        False,
        "xxh3-hash each leased KV block per KV head (prefill) and verify every pull against "
        "the hashes (decode); a mismatch is a failed pull (--kv-failure-policy)",
    )
    max_queue: int = opt(1024, "waiting requests beyond which new ones are refused")
    drain_seconds: float = opt(30.0, "on SIGTERM, how long in-flight requests may finish")
    standby: bool = opt(False, "load and register but take no requests until SIGUSR1 promotes it")

    def __post_init__(self) -> None:
        if self.kv_stream_threshold < -1:
            raise StartupError(
                f"--kv-stream-threshold must be -1 (auto), 0 (off) or a token count, "
                f"got {self.kv_stream_threshold}"
            )
        if self.kv_pull_timeout <= 0:
            raise StartupError(f"--kv-pull-timeout must be positive, got {self.kv_pull_timeout}")
        if self.kv_stream_layer_groups < 1:
            raise StartupError(
                f"--kv-stream-layer-groups must be at least 1, got {self.kv_stream_layer_groups}"
            )


@dataclass
class GatewayConfig(GatewayEdgeOptions):  # keys, per-key limits, HTTP limits
    host: str = opt("127.0.0.1", "HTTP bind address")
    port: int = opt(8000, "HTTP port")
    api_key: list[str] = opt(
        [],
        "accepted API key (a Bearer token, or x-api-key); repeat for several (env: comma separated)",
        multiple=True,
    )
    max_body_bytes: int = opt(4 * 1024 * 1024, "largest accepted HTTP request body")
    max_prompt_tokens: int = opt(0, "longest accepted prompt; 0 means the model's context")
    # A long answer that keeps producing tokens is never cut off by default: the limits that
    # are on by default catch requests that are stuck (queued, silent), not slow ones.
    request_timeout: float = opt(
        0.0,
        "total cap on one request, arrival to last token, seconds; 0 (the default) = none, so "
        "an answer that keeps streaming may run to the context length",
    )
    first_token_timeout: float = opt(
        300.0,
        "longest wait for a request's first token (queues, prefill, KV pull), and for the next "
        "token of a stream re-sent to another decode worker, seconds; 0 = none",
    )
    stall_timeout: float = opt(
        60.0,
        "longest silence between two tokens of a stream before it ends with a timeout error "
        "and is cancelled on its worker, seconds; 0 = none",
    )
    prefill_timeout: float = opt(60.0, "deadline for the prefill stage, seconds")
    max_queue: int = opt(1024, "in-flight requests beyond which new ones get 503")
    prefill_routing: str = opt(
        "kv",
        "kv: cheapest prefill worker given its cached prefix and load; round-robin: cache-blind (a baseline)",
        choices=("kv", "round-robin"),
    )
    worker_timeout: float = opt(
        3.0, "seconds without a heartbeat before a worker leaves the registry"
    )
    max_migrations: int = opt(
        3,
        "times one request may move to another decode worker when its own is lost mid-stream "
        "(it continues exactly from the tokens already sent); 0 ends it with an error instead",
    )
    tool_call_parser: str = opt(
        "auto",
        "the format tool calls are written in; auto: the chat template's own, or hermes for a "
        "template without tool syntax (the tools then go into a system prompt)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = opt(
        None,
        "split a reasoning model's thinking (between think tags) out of chat answers into "
        "reasoning_content: deepseek_r1 (the answer starts inside the reasoning) or qwen3 "
        "(reasoning only where the answer opens it, or the prompt leaves it open); default: "
        "none, all is content",
        choices=REASONING_PARSERS,
    )
    # POST /v1/responses keeps what it answered (store, previous_response_id) in a NATS
    # JetStream KV bucket, so every gateway replica can continue any conversation
    response_store_ttl: float = opt(
        30 * 24 * 3600.0,
        "seconds a stored response (/v1/responses with store) is kept in NATS JetStream "
        "before it expires (default 30 days, as OpenAI keeps them); 0 = until deleted",
    )
    prefix_cache_scope: str = opt(
        "key",
        "which requests may share cached prompt blocks, with --api-key set: key = only those of "
        "one API key and one cache_salt; global = those of one cache_salt (gateway/tenancy.py)",
        choices=("key", "global"),
    )
    response_store_replicas: int = opt(
        0,
        "copies JetStream keeps of the stored responses' KV bucket, on as many NATS cluster "
        "nodes (compose's and Kubernetes' 3-node clusters: 3); 1 to 5; 0 = 1, or under "
        "pdserve up --nats-cluster N, min(N, 3)",
    )

    def __post_init__(self) -> None:
        check_edge(self)
        if self.response_store_ttl < 0:
            raise StartupError(
                f"--response-store-ttl must be >= 0 (0 = no expiry), got {self.response_store_ttl}"
            )
        if not 0 <= self.response_store_replicas <= 5:  # JetStream's own limit
            raise StartupError(
                f"--response-store-replicas must be 0 (auto) to 5, "
                f"got {self.response_store_replicas}"
            )
        for name in ("request_timeout", "first_token_timeout", "stall_timeout"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise StartupError(f"{flag} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:  # argparse skips env defaults
            choices, bad = ", ".join(TOOL_CALL_PARSERS), self.tool_call_parser
            raise StartupError(f"--tool-call-parser must be one of {choices}, got {bad!r}")
        if self.reasoning_parser == "":  # an empty PDSERVE_REASONING_PARSER: none
            self.reasoning_parser = None
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            choices, bad = ", ".join(REASONING_PARSERS), self.reasoning_parser
            raise StartupError(f"--reasoning-parser must be one of {choices}, got {bad!r}")


@dataclass
class UpConfig:
    prefill_workers: int = opt(
        1, "prefill worker processes (default 1: disaggregated; 0 serves aggregated)"
    )
    decode_workers: int = opt(1, "decode worker processes")
    split_cpus: bool = opt(
        True,
        "give each worker its own share of the CPUs pdserve up may use, when there are at least "
        "as many as workers (--no-split-cpus: share them all)",
    )
    nats_url: str | None = opt(
        None, "use this NATS server (or cluster: URLs comma separated) instead of starting one"
    )
    nats_cluster: int = opt(
        1,
        "NATS nodes pdserve up starts when --nats-url is not given; above 1 they form a cluster "
        "(routes between them on loopback) and each worker prefers its own node, round-robin",
    )
    # Prefill is compute-bound and decode memory-bound, so the two roles may want different
    # shardings of one model; head-sliced KV pulls bridge any pair of sizes (shared/kv/tp_layout).
    prefill_tensor_parallel_size: int = opt(
        0, "ranks of each prefill worker; 0 = --tensor-parallel-size"
    )
    decode_tensor_parallel_size: int = opt(
        0,
        "ranks of each decode worker (also the aggregated workers of --prefill-workers 0); "
        "0 = --tensor-parallel-size",
    )
    # The live planner (services/control/autoscale.py): --prefill/--decode-workers are where it starts.
    autoscale: bool = opt(
        False,
        "add and remove prefill and decode workers while serving, from the gateway's metrics, "
        "the SLOs and a --planner-profile; a worker is removed only by a drain",
    )
    min_prefill_workers: int = opt(1, "fewest prefill workers --autoscale keeps")
    max_prefill_workers: int = opt(0, "most prefill workers --autoscale runs; 0 = the budget's")
    min_decode_workers: int = opt(1, "fewest decode workers --autoscale keeps")
    max_decode_workers: int = opt(0, "most decode workers --autoscale runs; 0 = the budget's")
    autoscale_max_cpus: float = opt(
        0.0, "CPU budget of --autoscale's workers, each costing its CPU share; 0 = this host's"
    )
    autoscale_max_gpus: int = opt(
        0, "GPU budget of --autoscale's workers, each costing a GPU per TP rank; 0 = this host's"
    )
    autoscale_interval: float = opt(10.0, "seconds between two --autoscale decisions")
    slo_ttft_ms: float = opt(1000.0, "time-to-first-token target --autoscale sizes for, ms")
    slo_itl_ms: float = opt(100.0, "inter-token latency target --autoscale sizes for, ms")
    slo_percentile: str = opt(
        "p99", "percentile the SLOs hold at", choices=("p50", "p90", "p95", "p99")
    )
    planner_profile: str | None = opt(
        None, "the Profile JSON --autoscale sizes with (what one worker of each role does here)"
    )
    planner_warmup_seconds: float = opt(
        60.0, "a worker younger than this neither corrects the planner's model nor is drained"
    )
    planner_metrics_port: int = opt(
        0, "port of --autoscale's /metrics (pdserve_planner_desired_workers...); 0 = off"
    )
    warm_prefill_workers: int = opt(
        0, "floor of --autoscale's warm pool: loaded, unrouted prefill workers it promotes first"
    )
    warm_decode_workers: int = opt(
        0, "floor of --autoscale's warm pool: loaded, unrouted decode workers it promotes first"
    )

    def __post_init__(self) -> None:
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise StartupError(
                    f"{flag} must be >= 0 (0 = --tensor-parallel-size), got {getattr(self, name)}"
                )

    def role_tensor_parallel_size(self, role: str, default: int) -> int:
        """The TP size of ``role``'s workers: its own option, else ``default`` (the engine's)."""
        own = (
            self.prefill_tensor_parallel_size
            if role == "prefill"
            else self.decode_tensor_parallel_size
        )
        return own or default


def all_option_names() -> dict[str, type]:
    """Every option name, mapped to the class that owns it (used by tests and compose checks)."""
    out: dict[str, type] = {}
    for cls in (BusConfig, EngineConfig, WorkerConfig, GatewayConfig, UpConfig):
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, cls)
    return out
