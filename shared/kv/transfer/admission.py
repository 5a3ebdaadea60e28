"""Admitting a KV pull on the prefill side: what a puller may have, decided before any KV byte
moves.

An authentic request (it shows the lease's token) is checked completely - the wire version, the
layout fingerprint, the heads and the form the puller receives in, the layer piece of a
streamed lease, the lease and its blocks - and answered with the messages to send, the lease
pinned (``Answer``), or with the reason it is refused (``Refusal``). ``server.py`` moves the
bytes; the rules of what it may move live here, in one place.
"""

from __future__ import annotations

import hmac
import struct

import msgpack

from pdserve.shared.kv.tp_layout import without_tp
from pdserve.shared.kv.transfer.answer import Answer, Refusal
from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer
from pdserve.shared.kv.transfer.lease import LeaseTable
from pdserve.shared.kv.transfer.request import SLICED, WHOLE, PullRequest
from pdserve.shared.kv.transfer.stream import FINISHED, LayerViews, parse_layers
from pdserve.shared.kv.transfer.wire import KV_WIRE_VERSION, BlockBytes, buffer, fingerprint_diff


class Admission:
    """The checks of a ``KVServer``: ``slicer`` and ``blocks`` read its cache, ``layer_views``
    its layers (None: no known parts, so no layer pieces), ``leases`` what may be pulled, and
    ``fingerprint`` its layout, which a puller's must equal but for TP."""

    def __init__(
        self,
        slicer: HeadSlicer,
        blocks: BlockBytes,
        layer_views: LayerViews | None,
        leases: LeaseTable,
        fingerprint: dict,
    ) -> None:
        self.slicer = slicer
        self.blocks = blocks
        self.layer_views = layer_views
        self.leases = leases
        self._layout = without_tp(fingerprint)  # what a puller's must equal
        self._matched: dict | None = None  # the last puller fingerprint that did

    def authentic(self, req: PullRequest) -> bool:
        """Whether the request shows the token of a live or recently dropped lease."""
        expected = self.leases.token_of(req.bus_id)
        return expected is not None and hmac.compare_digest(expected, req.token)

    def admit(self, req: PullRequest) -> Answer:
        """Check an authentic pull request completely before any KV byte moves - the version,
        the lease, the heads, the form the puller receives in - and take the messages to send
        (the lease pinned); or raise Refusal with the reason."""
        if req.version != KV_WIRE_VERSION:
            raise Refusal(f"KV wire version {req.version!r}; this server speaks {KV_WIRE_VERSION}")
        try:
            req.parse()
        except (ValueError, struct.error) as exc:
            raise Refusal(f"malformed pull request ({exc})") from None
        if req.fingerprint != self._matched:  # a puller's requests all carry the same one
            theirs = _fingerprint(req.fingerprint)
            if theirs != self._layout:  # TP alone may differ: head-sliced pulls bridge it
                raise Refusal(f"KV layout mismatch ({fingerprint_diff(self._layout, theirs)})")
            self._matched = req.fingerprint
        flags, runs = req.flags, req.runs
        try:
            heads, whole = self.slicer.requested(req.heads, bool(flags & WHOLE))
        except ValueError as exc:
            raise Refusal(str(exc)) from None
        sliced = bool(flags & SLICED)
        if not sliced and not (whole and heads == self.slicer.heads):
            # whole blocks only where both caches hold exactly these heads: the same layout
            raise Refusal(
                f"whole blocks asked, but this cache holds heads {list(self.slicer.heads)}"
            )
        if sliced and self.slicer.parts is None:
            raise Refusal("this KV cache cannot be head-sliced (no split given)")
        num_layers = self.slicer.parts[0].shape[1] if self.slicer.parts else 0
        try:
            piece = parse_layers(req.layers, req.final, num_layers)
        except ValueError as exc:
            raise Refusal(str(exc)) from None
        if piece is not None and (sliced or self.layer_views is None):
            raise Refusal("layer pieces move whole blocks of a cache with known parts")
        if piece is not None and req.checksum:
            raise Refusal("a streamed lease has no checksums: pull it in bulk")
        lease = self.leases.get(req.bus_id)
        if lease is None:
            if self.leases.ended(req.bus_id) == FINISHED:  # released before this pull came
                raise Refusal(FINISHED)
            raise Refusal(f"no lease for {req.bus_id} (expired or released)")
        if lease.block_set is None:  # checked by every pull of the lease: built once
            lease.block_set = frozenset(lease.block_ids)
        leased = lease.block_set
        for start, count in runs:
            if count < 1 or not (
                start in leased if count == 1 else leased.issuperset(range(start, start + count))
            ):
                raise Refusal("requested blocks are not part of the lease")
        epoch = req.epoch
        assert epoch is not None and runs is not None  # parse() read both
        if lease.epoch is not None and epoch != lease.epoch:
            raise Refusal(f"lease epoch {epoch} shown, {lease.epoch} leased")
        if self.leases.reused(epoch, runs):  # the table's word is not taken for it
            raise Refusal("leased blocks were freed and reused since the lease was taken")
        if piece is None:
            views, staged = self._views(runs, heads, sliced)
            piece = ((0, num_layers), True)
        else:
            try:
                views, staged = self.layer_views.of(runs, piece[0]), []
            except ValueError as exc:
                raise Refusal(str(exc)) from None
        self.leases.pin(lease)
        done = lease.stream is not None and all(
            k in lease.stream.done_blocks for s, n in runs for k in range(s, s + n)
        )  # blocks leased complete: sent at once
        # a bulk pull of a lease prefill still writes waits for all of it, like a final piece
        return Answer(
            lease=lease,
            heads=heads,
            sliced=sliced,
            views=views,
            staged=staged,
            layers=piece[0],
            final=piece[1],
            done=done,
        )

    def _views(self, runs: list[tuple[int, int]], heads: Heads, sliced: bool) -> tuple[list, list]:
        """One message per run - the blocks themselves, or their head slice (packed unless it
        is one contiguous piece of the cache) - and the staging copies among them."""
        if not sliced:
            return [self.blocks.message(start, count) for start, count in runs], []
        packed = [self.slicer.pack(start, count, heads) for start, count in runs]
        return [buffer(t) for t, _ in packed], [t for t, copied in packed if copied]


def _fingerprint(packed: object) -> dict:
    """A puller's layout fingerprint, from its packed form (``request.py``), TP left out."""
    try:
        fp = msgpack.unpackb(packed, raw=False, max_ext_len=0, strict_map_key=True)
    except Exception as exc:
        raise Refusal(f"malformed fingerprint ({exc!r})") from None
    if type(fp) is not dict:
        raise Refusal("malformed fingerprint")
    return without_tp(fp)
