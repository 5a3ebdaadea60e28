"""The in-process engine: prefill and decode with continuous batching over a paged KV cache.

A step is nano-vllm's: schedule, run, postprocess. The scheduler owns every request's lifecycle,
a status machine (``SequenceStatus``, drawn in ``sequence.py``): it picks each step's batch and
applies the runner's output (``Scheduler.update_from_output``). The engine around it owns the
model, the KV cache and the threading. A request with ``sampling.n > 1`` prefills once and forks
its other choices after that (``sequence_group.py``). With ``--speculative``, a decode step
also verifies drafted tokens inside the same forward pass (``spec/``; never a prefill engine).

The aggregated baseline runs this engine alone. Disaggregated workers run it too: a prefill worker
with ``prefill_only=True`` (``stream_hooks``: layer-wise KV streaming), a decode worker adding
requests with ``remote_kv=True`` and answering each ``KVPull`` with ``kv_ready`` or ``kv_failed``
(``kv_failure_policy``: local recompute or an error), as ``sequence.py``'s diagram draws.

Threading: one thread changes engine state, the one that calls ``step()``. Every other method
posts a command (``EngineCommands``, ``services/engine/commands.py``) that the next ``step()``
hands to the scheduler before it schedules, so there is no lock. ``EngineThread`` steps a
worker's engine; tests and benchmarks call ``step()`` in their own thread. ``stats()`` is a
snapshot taken at the end of each step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pdserve.services.engine import decode_graph
from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.commands import (
    Abort,
    AddRequest,
    Command,
    EngineCommands,
    HoldBlock,
    KVEventFeed,
    KVFailed,
    KVReady,
    LoadLora,
    Release,
    ResetPrefixCache,
    UnloadLora,
)
from pdserve.services.engine.guided import GuidedDecoder
from pdserve.services.engine.kv_fingerprint import kv_fingerprint
from pdserve.services.engine.kv_stream import StreamHooks
from pdserve.services.engine.loader import resolve_device_dtype
from pdserve.services.engine.lora.setup import build_adapter_cache
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.model_runner import ModelRunner
from pdserve.services.engine.model_setup import build_rank_model, kv_parts
from pdserve.services.engine.offload import KVOffload
from pdserve.services.engine.outputs import (
    EngineStats,
    KVPull,
    ScheduledBatch,
    StepOutput,
    StepResult,
    StepStats,
)
from pdserve.services.engine.parallel.group import RankFailed, RankGroup
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.quant.options import quantization_problem
from pdserve.services.engine.request_checks import check_request
from pdserve.services.engine.scheduler import KV_FAILURE_POLICIES, Scheduler
from pdserve.services.engine.spec import TargetModel, build_speculator
from pdserve.services.engine.step_cost import StepCost
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import ModelLoadError, StartupError
from pdserve.shared.kv.tp_layout import tp_problem
from pdserve.shared.kv.transfer.heads import Split
from pdserve.shared.models.resolve import describe, resolve
from pdserve.shared.sampling import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine(EngineCommands):
    def __init__(
        self, config: EngineConfig, prefill_only: bool = False, kv_failure_policy: str = "fail"
    ) -> None:
        super().__init__()  # the command queue first: a TP rank's failure wakes the engine thread
        if kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}")
        self.config = config
        self.prefill_only = prefill_only
        self.kv_failure_policy = kv_failure_policy
        self.resolved = resolve(config.model)
        self.model_dir = self.resolved.path
        self.is_demo = self.resolved.is_demo
        self.model_name = config.served_model_name or self.resolved.name
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir)
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        if self.device.type == "cuda":
            # Triton launches on the current device, not the tensors' one.
            torch.cuda.set_device(self.device)
        problem = quantization_problem(
            config.quantization, config.kv_cache_dtype, self.device, self.dtype
        )
        tp = config.tensor_parallel_size
        if problem is None:
            devices = torch.cuda.device_count() if self.device.type == "cuda" else None
            problem = tp_problem(cfg.num_heads, cfg.num_kv_heads, tp, devices)
        if problem is not None:
            raise StartupError(problem)
        # TP > 1: start the other ranks first, so they load their shards while we load ours
        self.ranks = RankGroup.start(config, self.model_dir, cfg, self.device) if tp > 1 else None
        try:  # a start that fails past here must not leave the ranks running
            self._build(config, cfg, prefill_only, kv_failure_policy)
        except BaseException:
            self.close()
            raise
        log.info(
            "model %s, served as %s in %s",
            describe(self.resolved),
            self.model_name,
            str(self.dtype).removeprefix("torch."),
        )
        if self.is_demo:
            log.warning(
                "serving the DEMO model (random weights, byte tokenizer): its text is noise"
            )

    def _build(
        self, config: EngineConfig, cfg: ModelConfig, prefill_only: bool, kv_failure_policy: str
    ) -> None:
        """Model, cache, scheduler and the rest (every rank's shard loads meanwhile)."""
        shard = self.ranks.shard if self.ranks is not None else Shard()
        built = build_rank_model(config, cfg, self.model_dir, self.device, self.dtype, shard)
        model, self.kv_spec, self.kv_cache = built.model, built.kv_spec, built.kv_cache
        self.shard = shard
        self.block_size = config.block_size
        self.num_blocks = built.num_blocks
        self.max_model_len = built.max_model_len
        if self.ranks is not None:
            self.ranks.wait_ready()
            self.ranks.on_failure(lambda _why: self.wake())

        # Engine-thread state: only ``step()`` and what it calls touch these.
        self.block_manager = BlockManager(self.num_blocks, self.block_size, config.prefix_cache)
        self.guided = GuidedDecoder(self.model_dir, cfg.vocab_size, cfg.eos_token_ids)
        self.runner = ModelRunner(model, self.kv_cache, self.block_size, self.device, self.guided)
        self.runner.ranks = self.ranks
        # LoRA adapters (--lora-modules): stacked slots in the model, pinned per sequence
        self.lora = build_adapter_cache(config, model)
        self.runner.serves_lora = self.lora is not None
        if self.lora is not None and self.ranks is not None:
            self.runner.lora_loads = self.lora.take_loads
        self.step_cost = StepCost.of_runner(self.runner, cfg, shard)  # the roofline's counts
        # speculative decoding (``spec/``): decode-side only, a prefill worker never drafts
        target = TargetModel(
            model_dir=self.model_dir,
            config=cfg,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
        )
        self.speculator = (
            None if prefill_only else build_speculator(config, self.max_model_len, target)
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            cfg.eos_token_ids,
            self.max_model_len,
            prefill_only=prefill_only,
            kv_failure_policy=kv_failure_policy,
            speculator=self.speculator,
            seed=config.seed,
            scheduling_policy=config.scheduling_policy,
            priority_aging_s=config.priority_aging_s,
            prompt_deadline_s=max(0.0, config.prompt_deadline_ms) / 1000.0,
            lora=self.lora,
        )
        self.offload = KVOffload.build(self)  # evicted blocks to host memory and disk, and back
        # Crossing threads out (commands come in through EngineCommands): the latest stats
        # snapshot and prefix-cache events.
        self._kv_feed: KVEventFeed | None = None
        self._stats = EngineStats(total_blocks=self.num_blocks, free_blocks=self.num_blocks)
        self.stream_hooks: StreamHooks | None = None  # a prefill worker's (kv_stream.py)
        # the compiled decode step (``--enforce-eager``: none), compiled before any request
        self.runner.graphs = decode_graph.build(model, config, self.device, prefill_only)

    def lora_names(self) -> tuple[str, ...]:
        return self.lora.served if self.lora is not None else ()

    # ---- sizing and layout -------------------------------------------------------------------

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The global KV heads this rank's cache holds (all of them at TP 1)."""
        return self.shard.kv_heads(self.model_config)

    @property
    def kv_split(self) -> Split:
        return kv_parts(self.kv_spec)

    def close(self) -> None:
        """Stop the other TP ranks and the disk tier's thread (a worker process just exits)."""
        if self.ranks is not None:
            self.ranks.close()
        if (offload := getattr(self, "offload", None)) is not None:  # (None: a failed start)
            offload.close()

    @property
    def bytes_per_block(self) -> int:
        return self.kv_spec.bytes_per_block

    def layout_fingerprint(self) -> dict[str, object]:
        """What must match between two engines for KV blocks to be copied as bytes."""
        return kv_fingerprint(
            self.model_name, self.model_config, self.dtype, self.config, self.shard, self.kv_spec
        )

    # ---- any thread (the commands themselves: EngineCommands) ---------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """ValueError if this model cannot serve the request (request_checks.py)."""
        vocab = self.model_config.vocab_size
        check_request(prompt_token_ids, sampling, vocab, self.max_model_len, self.guided)

    def stats(self) -> EngineStats:
        return self._stats

    def kv_event_feed(self) -> KVEventFeed:
        """Start handing out the prefix cache's changes (to one consumer thread)."""
        if self._kv_feed is None:
            self._kv_feed = self.offload.event_feed()  # with the offload tiers' events
        return self._kv_feed

    def has_unfinished(self) -> bool:
        """Work queued or in flight (for callers that step the engine themselves)."""
        return bool(self._commands) or self.scheduler.has_work()

    # ---- the step: the engine thread ---------------------------------------------------------

    def step(self) -> StepResult | None:
        """Apply posted commands, schedule, run one forward pass, apply its output. None when
        nothing happened."""
        if self.ranks is not None and self.ranks.failure is not None:
            raise RankFailed(self.ranks.failure)
        start_ns = time.time_ns()
        outputs: list[StepOutput] = []
        while self._commands:
            out = self._apply(self._commands.popleft())
            if out is not None:
                outputs.append(out)
            self._copy_blocks()  # a pull's answer may fork choices
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.offload.schedule(self.scheduler)
        stats = StepStats()
        pulls: list[KVPull] = []
        if batch is not None:
            pulls = [KVPull(s.bus_id, list(s.block_table)) for s in batch.pulls]
            if batch.seqs:
                stats = self._forward(batch, outputs)
        self._publish()
        if not (outputs or pulls or stats.num_seqs):
            return None
        return StepResult(
            outputs=outputs, pulls=pulls, stats=stats, start_ns=start_ns, end_ns=time.time_ns()
        )

    def _apply(self, cmd: Command) -> StepOutput | None:
        sch = self.scheduler
        if isinstance(cmd, AddRequest):
            return sch.add_request(cmd)
        if isinstance(cmd, KVFailed):
            return sch.kv_failed(cmd.bus_id, cmd.error)
        if isinstance(cmd, Abort):
            sch.abort(cmd.bus_id, cmd.index)
        elif isinstance(cmd, Release):
            sch.release(cmd.bus_id)
        elif isinstance(cmd, KVReady):
            sch.kv_ready(cmd.bus_id, cmd.first_token)
        elif isinstance(cmd, HoldBlock | ResetPrefixCache):
            sch.answer(cmd)
        elif isinstance(cmd, LoadLora | UnloadLora):
            self._lora_command(cmd)
        return None

    def _lora_command(self, cmd: LoadLora | UnloadLora) -> None:
        """Add or remove a served adapter (``POST /v1/load_lora_adapter``, ``unload``)."""
        try:
            if self.lora is None:
                raise ValueError("this worker serves no LoRA adapters: start it with --enable-lora")
            if isinstance(cmd, LoadLora):
                cmd.reply.set_result(self.lora.add(cmd.name, Path(cmd.path)))
            else:
                cmd.reply.set_result(self.lora.remove(cmd.name))
        except (ValueError, KeyError, ModelLoadError, OSError) as exc:
            cmd.reply.set_exception(exc)

    def _forward(self, batch: ScheduledBatch, outputs: list[StepOutput]) -> StepStats:
        t0 = time.perf_counter()
        if self.stream_hooks is not None:  # each layer this pass writes may be sent at once
            self.stream_hooks.before_forward(batch, self.runner.model)
        run = self.runner.run(batch)
        elapsed = time.perf_counter() - t0
        produced, stats = self.scheduler.update_from_output(batch, run)
        outputs += produced
        self._copy_blocks()  # choices forked from prompts completed in this pass
        stats.seconds = elapsed
        stats.flops, stats.bytes = self.step_cost.of(run.inputs)
        self.offload.observe_forward(stats)  # prices computing a block (the tiers' load costs)
        if self.speculator is not None and not stats.prefill_seqs:  # what a draft token costs
            self.speculator.cost.observe(batch.num_tokens, elapsed)
        return stats

    def _copy_blocks(self) -> None:
        """Forked choices' copy-on-write blocks, before anything else writes into the cache."""
        copies = self.scheduler.block_copies
        if copies:
            self.runner.copy_blocks(list(copies))
            copies.clear()

    def _publish(self) -> None:
        bm, sch = self.block_manager, self.scheduler
        self._stats = EngineStats(
            total_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            running=len(sch.running),
            waiting=len(sch.waiting),
            pulling=len(sch.pulling),
            preemptions=sch.num_preemptions,
            late_prompts=sch.waiting.num_late,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            spec=self.speculator.counters.snapshot() if self.speculator else None,
        )
        cleared, bm.cleared = bm.cleared, False  # reset_prefix_cache: AllBlocksCleared first
        if self._kv_feed is not None:
            if cleared:
                self._kv_feed.clear()
            stored, removed = bm.drain_events()
            if stored or removed:
                self._kv_feed.push(stored, removed, bm.take_lineage(stored))

    # ---- convenience for tests and the benchmark ---------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion in this thread; returns each prompt's output tokens (of
        choice 0; ``generate_choices`` returns every choice)."""
        return [choices[0] for choices in self.generate_choices(prompts, sampling)]

    def generate_choices(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[list[int]]]:
        """Run prompts to completion in this thread; returns each prompt's ``sampling.n``
        choices' output tokens."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, sp)
        outputs = {rid: [[] for _ in range(sp.n)] for rid, sp in zip(ids, params, strict=True)}
        while self.has_unfinished():
            result = self.step()
            for out in result.outputs if result else ():
                outputs[out.bus_id][out.index].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]
