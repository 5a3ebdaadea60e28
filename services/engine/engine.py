"""The in-process engine: prefill and decode with continuous batching over a paged KV cache.

The aggregated baseline runs this engine alone. Disaggregated workers run it too: a prefill worker
with ``prefill_only=True`` (sequences are parked with their blocks after the first token, until the
decode side has pulled them), a decode worker with ``reserve``/``activate`` for sequences whose KV
arrives over the network.

Threading: ``step()`` runs on one thread. The other methods may be called from any thread; they
take ``lock``, which ``step()`` holds only while scheduling and book-keeping, never during the
forward pass. Aborts of sequences inside the running forward are applied after it, because their
blocks are still being written.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from services.engine.block_manager import BlockManager
from services.engine.loader import load_model
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus
from shared.config import EngineConfig
from shared.models.resolve import describe, resolve
from shared.sampling import SamplingParams

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int = 0


@dataclass
class StepStats:
    num_seqs: int = 0
    num_decodes: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    prefill_seqs: list[str] = field(default_factory=list)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig, prefill_only: bool = False) -> None:
        self.config = config
        self.prefill_only = prefill_only
        self.resolved = resolve(config.model)
        self.model_dir = self.resolved.path
        self.is_demo = self.resolved.is_demo
        self.model_name = config.served_model_name or self.resolved.name
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir)
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        if self.device.type == "cuda":
            # Triton launches on the current device, not the tensors' one.
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        model = load_model(self.model_dir, cfg, self.device, self.dtype)

        self.block_size = config.block_size
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_gib)
        self.kv_cache = torch.zeros(
            num_blocks, cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        capacity = num_blocks * self.block_size
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, capacity)
        model.init_rope(self.max_model_len, self.device)

        self.block_manager = BlockManager(num_blocks, self.block_size, config.prefix_cache)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.runner = ModelRunner(model, self.kv_cache, self.block_size, self.device)
        self.lock = threading.Lock()
        self.seqs: dict[str, Sequence] = {}
        self._pending_aborts: set[str] = set()
        self._in_forward: set[str] = set()
        self._seed_rng = random.Random(config.seed)
        self.last_step = StepStats()
        log.info("model %s, served as %s in %s", describe(self.resolved), self.model_name,
                 str(self.dtype).removeprefix("torch."))  # fmt: skip
        if self.is_demo:
            log.warning(
                "serving the DEMO model (random weights, byte tokenizer): its text is noise"
            )

    # ---- sizing and layout -------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return cfg.num_layers * 2 * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _blocks_for_memory(self, gib: float) -> int:
        return max(1, int(gib * (1 << 30)) // self.bytes_per_block)

    def layout_fingerprint(self) -> dict[str, object]:
        """What must match between two engines for KV blocks to be copied as bytes."""
        cfg = self.model_config
        return {
            "model": self.model_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "num_layers": cfg.num_layers,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
        }

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )

    def _new_sequence(
        self, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate(prompt, sampling)
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(request_id, prompt, sampling, seed, time.monotonic())
        self.seqs[request_id] = seq
        return seq

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        with self.lock:
            self.scheduler.add(self._new_sequence(request_id, prompt_token_ids, sampling))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks return to the free list. False if unknown."""
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None:
                return False
            if request_id in self._in_forward:
                self._pending_aborts.add(request_id)
            else:
                self._finish(seq, "abort")
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- disaggregation hooks ----------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling: SamplingParams,
    ) -> list[int] | None:
        """Decode side: allocate blocks for a prompt whose KV will arrive from elsewhere.

        Returns the block ids to fill (in order), or None when the cache has no room now.
        """
        with self.lock:
            if not self.block_manager.can_fit(len(prompt_token_ids)):
                return None
            seq = self._new_sequence(request_id, prompt_token_ids, sampling)
            seq.token_ids.extend(output_token_ids)
            self.block_manager.allocate(seq, len(prompt_token_ids))
            seq.status = SequenceStatus.PREFILLED
            return list(seq.block_table)

    def activate(self, request_id: str) -> None:
        """Decode side: the reserved blocks now hold the prompt's KV; join the running batch."""
        with self.lock:
            seq = self.seqs[request_id]
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.block_manager.commit(seq)
            reason = self._finished_reason(seq)
            if reason is not None:
                # e.g. max_tokens already reached by the first token: nothing left to decode
                self._finish(seq, reason)
                return
            self.scheduler.add_running(seq)

    def recompute(self, request_id: str) -> None:
        """Decode side: the KV pull failed; compute the prefill here instead."""
        with self.lock:
            seq = self.seqs[request_id]
            self.block_manager.free_sequence(seq)
            seq.num_computed_tokens = 0
            self.scheduler.add(seq)

    def release(self, request_id: str) -> bool:
        """Free a parked (prefill worker) or reserved (decode worker) sequence's blocks."""
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None or seq.status is not SequenceStatus.PREFILLED:
                return False
            self._finish(seq, None)
            return True

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        """Prefix-cache block hashes (stored, removed) since the last call, for KV-aware routing."""
        with self.lock:
            return self.block_manager.drain_events()

    def drain_kv_snapshot(self) -> list[int]:
        """Every cached block hash now, and forget the pending events: taken under one lock, so
        the next ``drain_kv_events`` is exactly the change since this snapshot."""
        with self.lock:
            self.block_manager.drain_events()
            return list(self.block_manager.cached)

    def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (a snapshot for late-joining routers)."""
        with self.lock:
            return list(self.block_manager.cached)

    def blocks_of(self, request_id: str) -> tuple[list[int], int]:
        """Block ids and the number of tokens whose KV they hold, for a parked sequence."""
        seq = self.seqs[request_id]
        return list(seq.block_table), seq.num_computed_tokens

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        with self.lock:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            self._in_forward = {s.request_id for s in batch.seqs}
        t0 = time.perf_counter()
        tokens, rows = self.runner.run(batch)
        elapsed = time.perf_counter() - t0
        outputs: list[StepOutput] = []
        with self.lock:
            self._in_forward = set()
            sampled = dict(zip(rows, tokens.tolist(), strict=True))
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # finished or preempted meanwhile
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
                if seq.request_id in self._pending_aborts:
                    self._finish(seq, "abort")
                    continue
                if i not in sampled:
                    continue
                seq.token_ids.append(sampled[i])
                reason = self._finished_reason(seq)
                outputs.append(
                    StepOutput(seq.request_id, [sampled[i]], reason, seq.num_cached_tokens)
                )
                if reason is not None:
                    self._finish(seq, reason)
                elif self.prefill_only:
                    self.scheduler.park(seq)
            for rid in self._pending_aborts:
                if rid in self.seqs:
                    self._finish(self.seqs[rid], "abort")
            self._pending_aborts.clear()
            self.last_step = StepStats(
                num_seqs=len(batch.seqs),
                num_decodes=batch.num_decodes,
                num_tokens=batch.num_tokens,
                seconds=elapsed,
                prefill_seqs=[s.request_id for s in batch.seqs[batch.num_decodes :]],
            )
        return outputs

    def _finished_reason(self, seq: Sequence) -> str | None:
        if seq.num_output_tokens == 0:
            return None
        sp = seq.sampling
        last = seq.last_token
        if last in sp.stop_token_ids or (
            not sp.ignore_eos and last in self.model_config.eos_token_ids
        ):
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.request_id]

    # ---- convenience for tests and the benchmark ---------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion in this thread; returns each prompt's output tokens."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, sp)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]
