"""Plain-torch twins of every kernel: the CPU production path and the oracle for the Triton ones.

Every function has exactly the signature of its dispatch point in `kernels.ops`. They are
vectorised (no Python loop over sequences) because on CPU they *are* the engine's hot path, and
they accept the strided per-layer KV views `kv_cache[:, layer, 0]` without copying the cache.
Math runs in at least fp32 (fp64 stays fp64) and results are cast back to the input dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 stays fp64: the precision every kernel accumulates in."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm with an optional fused residual add (HF LlamaRMSNorm semantics).

    With a residual: s = x + residual; returns (rmsnorm(s) * weight, s). Without: (rmsnorm(x) *
    weight, None). The sum is rounded to the activation dtype first, as the unfused model does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xc = x.to(_compute_dtype(x.dtype))
    normed = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def _rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> Tensor:
    # fp32 exactly as HF computes it, so positions map to the same angles bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the
        # band in between is interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling rope_type {rope_type!r}")


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None,
    device: torch.device | str | None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """cos/sin table [max_position, head_dim]: first half cos, second half sin of the D/2 freqs."""
    inv_freq = _rope_inv_freq(head_dim, base, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache.to(device=device, dtype=dtype)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> None:
    """Rotate q [T,Hq,D] and k [T,Hk,D] in place, HF "rotate_half" (neox) style."""
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    for x in (q, k):
        xc = x.to(_compute_dtype(x.dtype))
        x1, x2 = xc.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated)


def _contiguous_blocks(cache: Tensor) -> bool:
    """Whether each block of ``cache`` [num_blocks, block_size, Hk, D] is one contiguous run."""
    _, _, heads, dim = cache.shape
    _, s_tok, s_head, s_dim = cache.stride()
    return s_dim == 1 and s_head == dim and s_tok == heads * dim


def _token_rows(cache: Tensor) -> tuple[Tensor, int] | None:
    """A [rows, Hk*D] view of a paged cache whose blocks keep (block_size, Hk, D) contiguous.

    Row ``block * per_block + offset`` is that token's slot, in the block-major layout as in a
    plain contiguous one. Single-index copies and gathers on this view are far faster on CPU than
    two-index advanced indexing through the strided per-layer view.
    """
    num_blocks, block_size, _, _ = cache.shape
    s_block, s_tok = cache.stride()[:2]
    if num_blocks == 0 or not _contiguous_blocks(cache) or s_block % s_tok:
        return None
    per_block = s_block // s_tok
    rows = (num_blocks - 1) * per_block + block_size
    return torch.as_strided(cache, (rows, s_tok), (s_tok, 1)), per_block


def _block_rows(cache: Tensor) -> Tensor | None:
    """A [num_blocks, block_size*Hk*D] view: one row per block. Gathering whole blocks (one
    contiguous 2-32 KiB row each) with ``index_select`` is about twice as fast on CPU as
    gathering token rows."""
    num_blocks, block_size, heads, dim = cache.shape
    if not _contiguous_blocks(cache):
        return None
    return torch.as_strided(cache, (num_blocks, block_size * heads * dim), (cache.stride(0), 1))


def store_kvcache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write key/value [T,Hk,D] into caches [num_blocks, block_size, Hk, D] at slot_mapping.

    slot = block_id * block_size + offset; slot -1 marks a token whose K/V is already cached.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_rows, v_rows = _token_rows(k_cache), _token_rows(v_cache)
    if k_rows is not None and v_rows is not None:
        rows = block_ids * k_rows[1] + offsets
        width = k_rows[0].shape[1]
        k_rows[0].index_copy_(0, rows, key[keep].reshape(len(rows), width).to(k_cache.dtype))
        v_rows[0].index_copy_(0, rows, value[keep].reshape(len(rows), width).to(v_cache.dtype))
        return
    # Two-index advanced assignment writes straight through any strided view.
    k_cache[block_ids, offsets] = key[keep].to(k_cache.dtype)
    v_cache[block_ids, offsets] = value[keep].to(v_cache.dtype)


def _gather_paged(cache: Tensor, block_tables: Tensor, num_blocks: int) -> Tensor:
    """[B, num_blocks*block_size, Hk, D] copy of each sequence's first num_blocks cache blocks."""
    table = _clamped_table(cache, block_tables, num_blocks)
    return _gather_blocks(cache, table)


def _gather_blocks(cache: Tensor, table: Tensor) -> Tensor:
    """[B, num_blocks*block_size, Hk, D] copy of the blocks ``table`` [B, num_blocks] names."""
    shape = (table.shape[0], table.shape[1] * cache.shape[1], *cache.shape[2:])
    rows = _block_rows(cache)
    if rows is not None:
        return rows.index_select(0, table.reshape(-1)).view(shape)
    return cache[table].reshape(shape)


def _clamped_table(cache: Tensor, block_tables: Tensor, num_blocks: int) -> Tensor:
    # Table slots past a sequence's end may hold padding (-1, stale ids); they are masked later,
    # but must still index something real.
    return block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)


class DecodePlan:
    """What every layer's decode attention shares within one forward pass: the length groups,
    each group's gather indices and masks. ``kernels.ops.decode_plan`` makes one per step and
    the model passes it to every layer, so this work runs once, not once per layer.

    Sequences are sorted by context length and cut into ``DECODE_LENGTH_GROUPS`` groups, each
    padded only to its own longest context: gathering pages is the cost on CPU, and one padded
    gather would pay for the longest context in the batch. A constant number of groups, not a
    loop over sequences.
    """

    def __init__(self, block_tables: Tensor, context_lens: Tensor) -> None:
        self.block_tables = block_tables
        self.context_lens = context_lens
        self._groups: list[_DecodeGroup] | None = None
        self._geometry: tuple[int, ...] | None = None

    def groups(self, cache: Tensor) -> list[_DecodeGroup]:
        # block ids are clamped to the cache and padded to its block size: other caches differ
        geometry = tuple(cache.shape[:2])
        if self._groups is None or geometry != self._geometry:
            self._groups = self._plan(cache)
            self._geometry = geometry
        return self._groups

    def _plan(self, cache: Tensor) -> list[_DecodeGroup]:
        lens = self.context_lens
        batch, block_size = lens.shape[0], cache.shape[1]
        count = min(DECODE_LENGTH_GROUPS, batch)
        members = [None] if count == 1 else list(torch.argsort(lens).tensor_split(count))
        groups = []
        for member in members:
            glens = lens if member is None else lens[member]
            tables = self.block_tables if member is None else self.block_tables[member]
            num_blocks = max(1, -(-int(glens.max()) // block_size))
            table = _clamped_table(cache, tables, num_blocks)
            token = torch.arange(num_blocks * block_size, device=lens.device)
            valid = token[None, :] < glens[:, None].to(token.dtype)  # [b, S]
            groups.append(
                _DecodeGroup(
                    members=member,
                    table=table,
                    mask=valid[:, None, None, :],
                    empty=None if bool((glens > 0).all()) else (glens == 0).view(-1, 1, 1, 1),
                )
            )
        return groups


class _DecodeGroup(NamedTuple):
    members: Tensor | None  # rows of the batch; None: all of them
    table: Tensor  # [b, num_blocks] block ids, clamped
    mask: Tensor  # [b, 1, 1, S] valid keys
    empty: Tensor | None  # [b, 1, 1, 1] sequences with no context (their output is zeros)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: DecodePlan | None = None,
) -> Tensor:
    """One query per sequence over its context_lens[i] cached tokens. q/out: [B, Hq, D].

    ``plan`` (from ``kernels.ops.decode_plan`` for these tables and lengths) skips re-planning.
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if plan is None:
        plan = DecodePlan(block_tables, context_lens)
    groups = plan.groups(k_cache)
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], scale)
    out = q.new_empty(q.shape)
    for group in groups:
        out[group.members] = _decode_group(q[group.members], k_cache, v_cache, group, scale)
    return out


DECODE_LENGTH_GROUPS = 8


def _decode_group(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, group: _DecodeGroup, scale: float
) -> Tensor:
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    cdt = _compute_dtype(q.dtype)
    keys = _gather_blocks(k_cache, group.table).to(cdt).transpose(1, 2)  # [b, Hk, S, D]
    values = _gather_blocks(v_cache, group.table).to(cdt).transpose(1, 2)
    # GQA without repeating K/V: the `group` query heads of one kv head act as `group` query
    # rows that all see the same keys (nothing is causal inside a decode step).
    qg = q.to(cdt).reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask, scale=scale)
    if group.empty is not None:  # an empty context has nothing to attend: zeros, not NaN
        out = out.masked_fill(group.empty, 0.0)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _pad_packed(x: Tensor, cu_seqlens: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Packed [T, ...] -> padded [B, max_len, ...] and the validity mask [B, max_len]."""
    starts = cu_seqlens[:-1].long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offs = torch.arange(max_len, device=x.device)
    index = starts[:, None] + offs[None, :]
    valid = offs[None, :] < lens[:, None]
    index = torch.where(valid, index, 0)
    return x[index], valid


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    k_cache: Tensor | None = None,
    v_cache: Tensor | None = None,
    block_tables: Tensor | None = None,
) -> Tensor:
    """Varlen causal attention with GQA over packed sequences; see kernels.ops for the contract."""
    num_tokens, num_q_heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = q.new_empty(q.shape)
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    cdt = _compute_dtype(q.dtype)
    q_pad, _ = _pad_packed(q, cu_seqlens_q, max_seqlen_q)  # [B, Mq, Hq, D]
    if block_tables is None:
        k_pad, k_valid = _pad_packed(k, cu_seqlens_k, max_seqlen_k)
        v_pad, _ = _pad_packed(v, cu_seqlens_k, max_seqlen_k)
    else:
        assert k_cache is not None and v_cache is not None
        num_blocks = -(-max_seqlen_k // k_cache.shape[1])
        k_pad = _gather_paged(k_cache, block_tables, num_blocks)
        v_pad = _gather_paged(v_cache, block_tables, num_blocks)
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
        k_valid = torch.arange(k_pad.shape[1], device=q.device)[None, :] < k_lens[:, None]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    # Query j of a sequence sits at absolute position k_len - q_len + j (cached prefix first).
    q_pos = (k_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=q.device)[None, :]
    k_pos = torch.arange(k_pad.shape[1], device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    # Padding query rows sit past the last key and so see every valid key: no all-masked row,
    # hence no NaN, and their output is dropped below anyway.
    attn = F.scaled_dot_product_attention(
        q_pad.to(cdt).transpose(1, 2),
        k_pad.to(cdt).transpose(1, 2),
        v_pad.to(cdt).transpose(1, 2),
        attn_mask=allowed[:, None, :, :],
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [B, Mq, Hq, D]
    token = torch.arange(num_tokens, device=q.device)
    seq_of_token = torch.searchsorted(cu_seqlens_q[1:].long(), token, right=True)
    pos_in_seq = token - cu_seqlens_q.long()[seq_of_token]
    out.copy_(attn[seq_of_token, pos_in_seq])
    return out
