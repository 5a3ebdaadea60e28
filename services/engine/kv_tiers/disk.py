"""The disk tier: KV blocks spilled from host memory, one file each (``block_file.py``), least
recently used first out, kept across restarts.

Every file operation runs on this tier's own thread, one job at a time in the order they were
posted, so the engine thread never waits on the disk. The index (block hash -> entry) is shared,
under a lock: the engine thread adds an entry when it posts the write, so a lookup finds the
block at once; a read posted after that runs after the write. Entries claimed for a load are
never evicted until the load has run.

Files are named by block hash and the tier's identity: the KV layout id and, for an engine,
the digest of its model's weights (``weights_digest.py``), which the thread computes as its
first job (so neither the start nor the engine thread waits for a pass over the weights; a
``layout`` read from another thread waits for it). At start the thread's second job rebuilds
the index from the directory: files of this identity are checked (header and length; the payload's checksum is checked when a block is read), oldest
first by modification time (a read touches its file, so the order survives a restart);
leftover temporaries, torn and corrupt files are removed and counted; files of another layout
or other weights are ignored (counted, left alone: another engine may be serving them). A block that fails its checksum when read is removed and
counted, and its load fails: the engine computes those tokens instead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.services.engine.kv_tiers.block_file import (
    SUFFIX,
    TMP_SUFFIX,
    BadBlockFile,
    file_name,
    file_size,
    parse_name,
    read_block,
    scan_header,
    write_block,
)

log = logging.getLogger(__name__)

# (the blocks read, in order, or None) and why not
LoadDone = Callable[[list[np.ndarray] | None, str], None]


@dataclass(eq=False)
class _Entry:
    size: int
    pins: int = 0  # loads posted and not run yet


@dataclass
class DiskCounts:
    """Since start (written by the disk thread; read anywhere)."""

    written: int = 0
    write_errors: int = 0
    evicted: int = 0
    loaded: int = 0
    corrupt_removed: int = 0  # torn, corrupt or failing its checksum: never served
    foreign_ignored: int = 0  # another layout's files, seen at the scan or a read
    other_weights_ignored: int = 0  # this layout's, from another checkpoint (the scan)
    scanned: int = 0  # files of this layout indexed at start


class DiskTier:
    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        block_bytes: int,
        layout: str,
        weights: Callable[[], str] | None = None,
    ) -> None:
        """``layout``: the KV layout id (16 hex); ``weights``: computes the weights digest (16
        hex) on the disk thread, appended to it in the files' identity (None: the layout alone).
        """
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.block_bytes = block_bytes
        self.base_layout = layout
        self._identity = layout
        self._identified = threading.Event()
        self.counts = DiskCounts()
        self._index: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)
        self._thread.start()
        if weights is None:
            self._identified.set()
        else:
            self._jobs.put(lambda: self._identify(weights))
        self._jobs.put(self._scan)

    # ---- any thread ----------------------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def layout(self) -> str:
        """The identity the files are named and headed by (waits for the weights digest)."""
        self._identified.wait()
        return self._identity

    def path(self, block_hash: int) -> Path:
        return self.dir / file_name(block_hash, self.layout)

    def flush(self) -> None:
        """Wait until every job posted so far has run (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    # ---- the engine thread ---------------------------------------------------------------------

    def claim(self, block_hash: int) -> bool:
        """Keep ``block_hash`` until a ``load`` of it has run (False: not here)."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:
                return False
            entry.pins += 1
            self._index.move_to_end(block_hash)
            return True

    def put(self, block_hash: int, payload: np.ndarray, done: Callable[[], None]) -> None:
        """Write a block (``payload``: its bytes, valid until ``done`` is called on the disk
        thread), evicting the least recently used files beyond the capacity."""
        size = file_size(self.block_bytes)
        with self._lock:
            known = block_hash in self._index
            if known:
                self._index.move_to_end(block_hash)
            if known or size > self.capacity:
                done()
                return
            self._index[block_hash] = _Entry(size)
            self._bytes += size
            evicted = self._evict_over_capacity()
        for h in evicted:
            self._jobs.put(lambda h=h: self._delete(h))
        self._jobs.put(lambda: self._write(block_hash, payload, done))

    def load(self, hashes: list[int], done: LoadDone) -> None:
        """Read claimed blocks on the disk thread; ``done`` gets them there (or None and why)."""
        self._jobs.put(lambda: self._read(hashes, done))

    def clear(self) -> list[int]:
        """Forget every block no load has claimed and delete its file (a reset); the hashes.
        The deletions run after the writes posted before, so no file is left behind."""
        with self._lock:
            gone = [h for h, entry in self._index.items() if entry.pins == 0]
            for h in gone:
                self._bytes -= self._index.pop(h).size
        for h in gone:
            self._jobs.put(lambda h=h: self._delete(h))
        return gone

    def _evict_over_capacity(self) -> list[int]:
        """Drop index entries (least recently used, unclaimed) until the capacity holds; the
        caller deletes their files. Under the lock."""
        evicted: list[int] = []
        excess = self._bytes - self.capacity
        for h, entry in self._index.items():  # least recently used first; stop once enough
            if excess <= 0:
                break
            if entry.pins == 0:
                evicted.append(h)
                excess -= entry.size
        for h in evicted:
            self._bytes -= self._index.pop(h).size
        self.counts.evicted += len(evicted)
        return evicted

    # ---- the disk thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a cache: log it, keep serving
                log.exception("KV disk tier job failed")
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _identify(self, weights: Callable[[], str]) -> None:
        try:
            digest = weights()
            log.info("KV disk tier: model weights digest %s", digest)
        except Exception:  # unreadable weights: keep nothing across restarts rather than guess
            digest = os.urandom(8).hex()
            log.exception("KV disk tier: no weights digest; its files will not be reused")
        self._identity = self.base_layout + digest
        self._identified.set()

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is not None:
                self._bytes -= entry.size

    def _delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def _write(self, block_hash: int, payload: np.ndarray, done: Callable[[], None]) -> None:
        try:
            write_block(self.path(block_hash), self.layout, block_hash, payload)
            self.counts.written += 1
        except OSError as exc:  # e.g. a full disk: the block is only lost, never wrong
            self.counts.write_errors += 1
            log.warning("could not write KV block %016x: %s", block_hash, exc)
            self._forget(block_hash)
        finally:
            done()

    def _read(self, hashes: list[int], done: LoadDone) -> None:
        blocks: list[np.ndarray] = []
        error = ""
        try:
            for h in hashes:
                path = self.path(h)
                try:
                    blocks.append(read_block(path, self.layout, h, self.block_bytes))
                    os.utime(path)  # recently used, across a restart too
                except BadBlockFile as exc:
                    self._bad_file(path, h, exc, indexed=True)
                    error = f"KV block {h:016x} on disk: {exc}"
                    break
                except OSError as exc:
                    self._forget(h)
                    error = f"KV block {h:016x} could not be read: {exc}"
                    break
            else:
                self.counts.loaded += len(blocks)
        finally:
            with self._lock:
                for h in hashes:
                    if (entry := self._index.get(h)) is not None:
                        entry.pins -= 1
        done(None if error else blocks, error)

    def _bad_file(self, path: Path, block_hash: int, exc: BadBlockFile, indexed: bool) -> None:
        if indexed:
            self._forget(block_hash)
        if exc.kind == "foreign":
            self.counts.foreign_ignored += 1
            log.warning("ignoring %s: %s", path.name, exc)
            return
        self.counts.corrupt_removed += 1
        log.warning("removing %s, never served: %s", path.name, exc)
        path.unlink(missing_ok=True)

    def _scan(self) -> None:
        found: list[tuple[float, int, int]] = []  # (mtime, hash, size)
        tmp_tail = f".{self.layout}{SUFFIX}{TMP_SUFFIX}"
        with os.scandir(self.dir) as entries:
            for entry in entries:
                h = parse_name(entry.name, self.layout)
                if h is None:
                    if entry.name.endswith(tmp_tail):  # a write a crash cut short
                        self.counts.corrupt_removed += 1
                        Path(entry.path).unlink(missing_ok=True)
                    elif entry.name.endswith(SUFFIX):
                        # our layout under another weights digest: another checkpoint's
                        same_layout = entry.name.startswith(f".{self.base_layout}", 16)
                        if same_layout and self.layout != self.base_layout:
                            self.counts.other_weights_ignored += 1
                        else:
                            self.counts.foreign_ignored += 1
                    continue
                try:
                    size = scan_header(Path(entry.path), self.layout, h, self.block_bytes)
                    found.append((entry.stat().st_mtime, h, size))
                except BadBlockFile as exc:
                    self._bad_file(Path(entry.path), h, exc, indexed=False)
                except OSError as exc:
                    log.warning("skipping %s: %s", entry.name, exc)
        found.sort()
        with self._lock:
            # what the engine posted meanwhile is newer than anything found
            index = OrderedDict((h, _Entry(size)) for _, h, size in found if h not in self._index)
            self._bytes += sum(e.size for e in index.values())
            index.update(self._index)
            self._index = index
            self.counts.scanned = len(found)
            evicted = self._evict_over_capacity()
        for h in evicted:
            self._delete(h)
        log.info(
            "KV disk tier %s: %d blocks indexed (%d removed; ignored: %d of other layouts, "
            "%d of other weights)",
            self.dir,
            len(self._index),
            self.counts.corrupt_removed,
            self.counts.foreign_ignored,
            self.counts.other_weights_ignored,
        )
