"""The decode step as compiled graphs, one per batch-size bucket (``--enforce-eager``: none).

Why: a decode step on a CPU is memory-bound, and the eager model spent as long in per-layer
glue (norms, rotary, the KV write, Python between ~20 ops a layer) as in reading its weights.
Compiled with Inductor, each layer's glue becomes a few fused C++ loops around the matmuls, and
decode attention reads the KV pages in place (``kernels/paged_decode.py``).

What runs here: a step whose every row decodes one token or verifies drafts (no prompt chunk,
no prompt log-probs), at TP 1, with no layer hook, of at most the largest bucket's tokens.
Anything else runs eagerly, as before.

- **Verification rows, flattened.** A row that verifies K drafts has 1 + K query tokens; each
  becomes a row of the graph with its own position and context length (the tokens up to and
  including itself). Every token's K/V is written before attention reads, so the flattened rows
  see exactly the causal context the eager path's prefill attention gives them. Speculation then
  runs on the compiled step too, rather than falling back to eager steps where it drafts.

- **Buckets.** The rows are padded to the next bucket (1, 2, 4, 8, then multiples of 8, as
  vLLM's CUDA graphs do). A padding row repeats row 0: it writes row 0's K/V to row 0's slot
  again (the same values) and its output is dropped. The same bucketing serves CUDA graphs.
- **Tensors, not host values.** Block tables and context lengths are inputs; the table's block
  count is a dynamic size (at least 2, so it is never specialised to 1), so a longer context
  never recompiles.
- **One layer, compiled once.** The graph is one decoder layer, and every layer runs it with its
  own weights and cache views as the graph's inputs: compiling 30 layers costs one layer. On a
  CPU the batch size is dynamic too, so bucket 1 and one graph for all larger buckets are all
  that compile. Python between layers is one guarded call each.
- **Compiled at start.** ``compile()`` runs every graph once on dummy rows before the engine
  takes a request, logs how long it took, and counts compilations; a compilation after that
  (``recompiles``) is a bug the tests look for. Inductor's cache (under pdserve's cache folder)
  makes a restart's compile a cache load.
"""

from __future__ import annotations

import logging
import os
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels import graph_ops
from pdserve.services.engine import cpu_decoder
from pdserve.services.engine.model import DecoderLayer, GraphDecodeMetadata, LlamaForCausalLM
from pdserve.services.engine.outputs import StepInputs
from pdserve.shared.config import EngineConfig
from pdserve.shared.models.demo import cache_dir

log = logging.getLogger(__name__)

MIN_TABLE_BLOCKS = 2  # a dynamic size of 1 would be specialised, and recompile for 2


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to the first bucket that holds ``max_batch``."""
    out = [1, 2, 4, 8]
    while out[-1] < max_batch:
        out.append(out[-1] + 8)
    return [b for b in out if b < max_batch] + [next(b for b in out if b >= max_batch)]


def wanted(config: EngineConfig, device: torch.device, prefill_only: bool) -> bool:
    """Whether an engine compiles its decode step: a decode-capable CPU engine at TP 1 with
    a float KV cache, unless ``--enforce-eager``. (CUDA graphs are their own issue; a quantized
    cache's values and scales are two views of one storage, which a graph would take as
    aliased inputs.) INT8 weights compile too: fbgemm's layers are opaque ops in the graph."""
    return (
        not config.enforce_eager
        and not prefill_only
        and device.type == "cpu"
        and config.tensor_parallel_size == 1
        and config.kv_cache_dtype == "auto"
    )


def build(
    model: LlamaForCausalLM, config: EngineConfig, device: torch.device, prefill_only: bool
) -> DecodeGraphs | None:
    """An engine's compiled decode step, compiled now; None where it runs eagerly."""
    if not wanted(config, device, prefill_only):
        return None
    lora = bool(config.lora_modules) or config.enable_lora
    graphs = DecodeGraphs(model, config.block_size, config.max_num_seqs, lora)
    if config.cpu_fused_decode and not lora:
        graphs.fused = cpu_decoder.build(model)
        graphs.fused_rows = cpu_decoder.max_rows(model)
    graphs.compile()
    return graphs


def inductor_cache_dir() -> Path:
    """Inductor's compiled code, kept across restarts (``TORCHINDUCTOR_CACHE_DIR`` wins)."""
    return cache_dir() / "inductor"


class _CountingInductor:
    """Inductor, counting the graphs it is handed: each one is a compilation."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)


def _run_layer(
    layer: DecoderLayer,
    positions: torch.Tensor,
    h: torch.Tensor,
    residual: torch.Tensor,
    meta: GraphDecodeMetadata,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(positions, h, residual, meta, cos_sin)


@dataclass
class _Batch:
    """A step's rows, padded to their bucket, as the graph's tensors."""

    rows: int  # the real ones (one a token), first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: GraphDecodeMetadata


class DecodeGraphs:
    """The compiled decode step of one model and its cache (TP 1, a CPU or a GPU)."""

    def __init__(
        self, model: LlamaForCausalLM, block_size: int, max_batch: int, lora: bool = False
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.buckets = buckets_up_to(max_batch)
        self.device = model.embed_tokens.weight.device
        self._first_pages = model.decoder_layers()[0].self_attn.kv_pages
        if not graph_ops.fits(self._first_pages):
            raise ValueError("the compiled decode step needs the block-major float KV cache")
        self._backend = _CountingInductor()
        # one guarded entry per bucket graph, plus slack: never fall back to eager silently
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 2 * len(self.buckets)
        )
        # A code object of its own: Dynamo keeps compiled graphs per code object, so engines
        # sharing ``_run_layer``'s would pile their graphs onto one recompile limit (a test
        # session hit it), and, with only tensor guards kept, one model's graph could serve
        # another of the same shapes (its eps and scale are constants in the graph).
        run_layer = types.FunctionType(_run_layer.__code__.replace(), _run_layer.__globals__)
        self._layer = torch.compile(
            run_layer,
            backend=self._backend,
            fullgraph=True,
            options={"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe},
        )
        # LoRA adapters are served: every step passes each row's slot (``_lora_slots``)
        self.lora = lora
        # the C++ decoder that runs steps of up to ``fused_rows`` rows (cpu_decoder.py)
        self.fused: object | None = None
        self.fused_rows = cpu_decoder.MAX_ROWS
        self.fused_steps = 0  # of ``steps``, those the C++ decoder ran
        self.compiled_at_start = 0  # compilations made by compile(), before any request
        self.steps = 0  # steps run through the graphs (the start's dummy ones included)
        self.verify_steps = 0  # of them, steps with speculative verification rows

    @property
    def compilations(self) -> int:
        return self._backend.graphs

    @property
    def recompiles(self) -> int:
        """Compilations after start: each one stalled a request's step."""
        return self._backend.graphs - self.compiled_at_start

    def serves(self, inputs: StepInputs) -> bool:
        """Whether this step is one the graphs run: decode and verification rows only, every
        token of them sampled (``read`` is the flat batch, in order)."""
        tokens = len(inputs.input_ids)
        return (
            0 < tokens <= self.buckets[-1]
            and inputs.num_decodes + inputs.num_verifies == len(inputs.counts)
            and inputs.num_sampled == tokens
            and inputs.read == list(range(tokens))
            and self.model.layer_hook is None
        )

    def _runs_fused(self, rows: int) -> bool:
        return self.fused is not None and rows <= self.fused_rows

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def compile(self) -> float:
        """Compile every graph on dummy rows (they write block 0, which no request holds yet);
        returns the seconds it took."""
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        start = time.perf_counter()
        # the smallest graph, then the dynamic one for every larger bucket (a second shape
        # makes Dynamo's sizes dynamic); buckets the C++ decoder runs need no graph
        graph_buckets = [b for b in self.buckets if not self._runs_fused(b)]
        for rows in sorted({graph_buckets[0], graph_buckets[-1]} if graph_buckets else set()):
            dummy = StepInputs(
                input_ids=[0] * rows,
                counts=[1] * rows,
                starts=[1] * rows,
                block_tables=[[0]] * rows,
                num_decodes=rows,
                num_verifies=0,
                read=list(range(rows)),
                num_sampled=rows,
                lora_slots=[0] * rows if self.lora else [],
            )
            self.run(dummy)
        seconds = time.perf_counter() - start
        self.compiled_at_start = self._backend.graphs
        log.info(
            "decode step compiled: %d graphs for buckets %s in %.1f s (the C++ decoder: %s)",
            self.compiled_at_start,
            graph_buckets,
            seconds,
            _rows_served(self.fused_rows) if self.fused is not None else "off",
        )
        return seconds

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states (normed) of the step's rows, in order."""
        self.steps += 1
        self.verify_steps += inputs.num_verifies > 0
        model = self.model
        if self._runs_fused(len(inputs.input_ids)):
            self.fused_steps += 1
            rows = _token_rows(inputs)
            return self.fused.forward(  # type: ignore[attr-defined]
                rows.ids, rows.positions, rows.table, model.cos_sin
            )
        batch = self._pad(inputs)
        h = model.embed_tokens(batch.input_ids)
        # the first layer adds a zero residual: the same sums as the eager model, one graph
        residual = torch.zeros_like(h)
        for layer in model.decoder_layers():
            h, residual = self._layer(
                layer, batch.positions, h, residual, batch.meta, model.cos_sin
            )
        h, _ = model.norm(h[: batch.rows], residual[: batch.rows])
        return h

    def _lora_slots(
        self, inputs: StepInputs, token_row: torch.Tensor | None, extra: int
    ) -> torch.Tensor | None:
        """Each padded token's LoRA slot (its step row's). A padding row repeats token 0, its
        slot too: it writes its K/V over token 0's, which must be the same values. Where adapters
        are served the graph always takes the slots, even in a step of base rows only: a step
        without them would be another graph, compiled mid-serving."""
        if not self.lora:
            return None
        slots = torch.tensor(inputs.lora_slots, dtype=torch.int64)
        if token_row is not None:
            slots = slots[token_row]
        slots = torch.cat((slots, slots[:1].expand(extra)))
        if slots.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(slots, 0)
        return slots.to(self.device, non_blocking=True)

    def _pad(self, inputs: StepInputs) -> _Batch:
        tokens = len(inputs.input_ids)
        padded = self.bucket(tokens)
        extra = padded - tokens
        rows = _token_rows(inputs)
        # padding repeats token 0
        table = torch.cat((rows.table, rows.table[:1].expand(extra, -1)))
        positions = torch.cat((rows.positions, rows.positions[:1].expand(extra)))
        ids = torch.cat((rows.ids, rows.ids[:1].expand(extra)))
        bs = self.block_size
        slots = table.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        if self.device.type != "cpu":
            table, positions, ids, slots = (
                t.to(self.device, non_blocking=True) for t in (table, positions, ids, slots)
            )
        torch._dynamo.maybe_mark_dynamic(table, 1)
        if padded > 1:
            torch._dynamo.maybe_mark_dynamic(table, 0)
            for t in (positions, ids):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        kv_rows = graph_ops.kv_rows(self._first_pages, slots)
        if padded > 1:
            torch._dynamo.maybe_mark_dynamic(kv_rows, 1)
        meta = GraphDecodeMetadata(
            kv_rows=kv_rows,
            block_tables=table,
            context_lens=positions + 1,
            lora_slots=self._lora_slots(inputs, rows.token_row, extra),
        )
        return _Batch(rows=tokens, input_ids=ids, positions=positions, meta=meta)


def _rows_served(most: int) -> str:
    return "steps of any width" if most == cpu_decoder.ANY_ROWS else f"steps of 1-{most} rows"


@dataclass
class _TokenRows:
    """A step's tokens as rows (a verification row's tokens each a row of its own)."""

    ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor  # [tokens, blocks]: each token's sequence's block table
    token_row: torch.Tensor | None  # each token's step row, where a row verifies drafts


def _token_rows(inputs: StepInputs) -> _TokenRows:
    """The step's tokens as rows, in few ops: for the C++ decoder's steps this is most of the
    Python a step has besides the engine's."""
    tables = inputs.block_tables
    lengths = torch.tensor([len(t) for t in tables])
    width = max(MIN_TABLE_BLOCKS, int(lengths.max()))
    flat = torch.tensor([b for t in tables for b in t], dtype=torch.int64)
    # each row's blocks at the start of its table row: one masked fill, in row order
    table = torch.zeros(len(tables), width, dtype=torch.int64)
    table.masked_scatter_(torch.arange(width) < lengths[:, None], flat)
    positions = torch.tensor(inputs.starts, dtype=torch.int64)
    token_row = None
    if len(inputs.input_ids) > len(tables):  # verification rows: one row per query token
        token_row, offset = _runs(torch.tensor(inputs.counts))
        table, positions = table[token_row], positions[token_row] + offset
    ids = torch.tensor(inputs.input_ids, dtype=torch.int64)
    return _TokenRows(ids=ids, positions=positions, table=table, token_row=token_row)


def _runs(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of ``lengths`` items laid end to end: each item's run and its index in the run
    (vectorised: no loop over the runs)."""
    run_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    firsts = torch.cumsum(lengths, 0) - lengths
    return run_of, torch.arange(len(run_of)) - torch.repeat_interleave(firsts, lengths)
