"""The KV cache's second tier: blocks of KV that outlive their eviction from the pool, and restarts.

The pool holds the KV the radix tree can share now; when it is evicted, it is written here (a
file per block) instead of lost, and a later request whose prompt continues past what the tree
holds reads it back into fresh pages instead of prefilling it again (`scheduler/kv_manager.py`
does both). On a CPU the pool is already host memory, so the tier below it is a folder.

A block is `block_tokens` consecutive tokens starting at a multiple of it, keyed by the hash of
every token from the sequence's start to the block's end (`block_keys`): the key names the whole
prefix, so a block is only ever read where the same tokens precede it, and a restarted server
finds the blocks of prompts it saw before. The folder for one model is named by its identity
(weights, dtype, quantization, page size, block size, the draft model's if any): blocks written
by another model or another configuration are never read. Each file carries its identity, key,
length and two digests (header and payload); a write goes to a temporary name and is renamed
into place, so a crash mid-write leaves no file under a real name, and a file damaged any other
way fails its digest when read: it is deleted and counted, never read as KV.

Writes run on a background thread (`put` only queues a host copy of the block, made without
waiting for the device: `host_copy`); a queued block can be read before it reaches the disk.
What is queued is bounded (`max_queued_bytes`): when evictions outpace the disk, blocks beyond it
are not saved (counted, `writes_dropped`, and logged once), so host memory does not grow. A
failed write is counted (`writes_failed`) and logged, its traceback once. The folder is kept
under `capacity` bytes, least recently used blocks deleted first. A folder whose only blocks
were written under other identities (another model, precision, page or block size) says so at
start, in the log and in `info()`: a restart that changed any of those starts cold. `check`
asserts the tier's own accounting: bytes on disk, blocks, in-flight writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from radixlm.runtime.cache.kv_pool import KVPool

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # tokens per block (rounded up to a multiple of the page size)
MAX_QUEUED_BYTES = 256 << 20  # blocks waiting for the disk, at most (host memory)
_IDENTITY_FILE = "identity.txt"  # in each identity's folder: what it was written under, for people
_MAGIC = b"RLMKV\x00\x01\x00"
_HEADER = struct.Struct("<8s16s32sQ16s")  # magic, identity, key, payload bytes, payload digest
_HEADER_DIGEST = 16
HEADER_BYTES = _HEADER.size + _HEADER_DIGEST


def _digest(data: bytes | memoryview, size: int = 16) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """The key of each whole block of `tokens`: a hash chained over the blocks, so block i's key
    is a hash of tokens[0 : (i + 1) * block_tokens]."""
    keys, prev = [], b""
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        prev = _digest(prev + struct.pack(f"<{block_tokens}q", *tokens[end - block_tokens : end]), 32)
        keys.append(prev)
    return keys


@dataclass
class TierStats:
    hits: int = 0  # requests that read blocks
    blocks_read: int = 0
    tokens_loaded: int = 0  # tokens whose KV came from the tier instead of a prefill
    bytes_read: int = 0
    load_seconds: float = 0.0  # reading, checking and copying into the pool
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_dropped: int = 0  # deleted to stay under capacity
    writes_failed: int = 0
    read_failures: int = 0  # reads that raised (treated as misses)
    writes_dropped: int = 0  # not saved: the write queue was full (evictions outpaced the disk)
    corrupt_skipped: int = 0  # files that failed their checks when read: deleted, never used


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(a host copy of `t`, what to wait on before reading it, or None). From a GPU the copy goes
    to pinned memory without waiting for the device (a step may be running); the event marks
    when it has landed."""
    if t.device.type == "cpu":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    if t.device.type != "cuda":
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class FileTier:
    """Blocks of KV bytes in a folder, by key; LRU under `capacity` bytes; written in the background."""

    def __init__(self, root: str, identity: str, capacity: int, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.identity = _digest(identity.encode())
        self.folder = os.path.join(root, self.identity.hex())
        self.capacity = capacity
        self.max_queued_bytes = max_queued_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # guards _index, _pending and the byte counts
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._pending: dict[bytes, tuple[torch.Tensor, Any]] = {}  # queued, not yet on disk: (payload, ready)
        self._pending_bytes = 0
        self._warned: set[str] = set()  # what was logged once
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, _IDENTITY_FILE), "w") as f:
            f.write(identity + "\n")
        self._scan()
        self.other_identities = self._others(root)  # identity text -> blocks, of the folder's other identities
        if self.other_identities and not self._index:
            log.warning("KV tier: %s holds %d blocks, all written under other configurations (%s); none can be "
                        "read by this one (%s): this start is cold", root, sum(self.other_identities.values()),
                        "; ".join(sorted(self.other_identities)[:3]), identity)
        self._queue: queue.Queue[tuple[bytes, torch.Tensor, Any] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="radixlm-kv-tier", daemon=True)
        self._writer.start()

    # ---- what the scheduler calls ------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks on disk (read each step for the dashboard: len() of a dict needs no lock)."""
        return len(self._index)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def put(self, key: bytes, payload: torch.Tensor, ready: Any = None) -> None:
        """Queue a block for writing; `payload` must be the caller's own host copy (it is kept),
        readable once `ready` (an event, or None: now) has been waited on (`host_copy`)."""
        assert payload.device.type == "cpu", payload.device
        size = HEADER_BYTES + payload.numel() * payload.element_size()
        with self._lock:
            if key in self._index or key in self._pending or size > self.capacity:
                return
            if self._pending_bytes + size > self.max_queued_bytes:
                self.stats.writes_dropped += 1
                full = True
            else:
                full = False
                self._pending[key] = (payload, ready)
                self._pending_bytes += size
        if full:
            self._warn_once("full", "KV tier: the write queue is full (%d bytes): evictions outpace the disk, so "
                            "blocks are left unsaved (counted in writes_dropped)", self.max_queued_bytes)
            return
        self._queue.put((key, payload, ready))

    def read_leading(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks of the longest head of `keys` the tier has, in order (reading stops at the
        first it lacks or that fails a check)."""
        out = []
        for key in keys:
            payload = self.read(key)
            if payload is None:
                break
            out.append(payload)
        return out

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes (uint8), or None when it is absent or its file fails a check."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                return _landed(*pending).view(-1).view(torch.uint8)
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:  # deleted meanwhile to make room (or by hand): simply absent
            self._forget(key)
            return None
        except OSError:
            data = bytearray()
        if not self._valid(key, data):
            self.stats.corrupt_skipped += 1
            log.warning("KV tier: %s failed its checks; deleted", path)
            self._forget(key)
            return None
        self.stats.blocks_read += 1
        self.stats.bytes_read += len(data)
        return torch.frombuffer(data, dtype=torch.uint8, offset=HEADER_BYTES)

    def drain(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._writer.join()

    def check(self) -> None:
        """The tier's accounting: the index's bytes add up and stay under capacity, every queued
        write is counted once and is not also on disk."""
        with self._lock:
            assert self._bytes == sum(self._index.values()), (self._bytes, sum(self._index.values()))
            assert self._bytes <= self.capacity, (self._bytes, self.capacity)
            pending = sum(HEADER_BYTES + t.numel() * t.element_size() for t, _ in self._pending.values())
            assert self._pending_bytes <= self.max_queued_bytes, (self._pending_bytes, self.max_queued_bytes)
            assert self._pending_bytes == pending, (self._pending_bytes, pending)
            assert not set(self._pending) & set(self._index), "a block both queued and on disk"

    def check_files(self) -> None:
        """Tests: the files on disk are exactly the index's, with its sizes (call after `drain`)."""
        on_disk = {}
        for sub in os.listdir(self.folder):
            if not os.path.isdir(os.path.join(self.folder, sub)):
                continue
            for name in os.listdir(os.path.join(self.folder, sub)):
                on_disk[bytes.fromhex(name.removesuffix(".kv"))] = os.path.getsize(os.path.join(self.folder, sub, name))
        with self._lock:
            assert on_disk == dict(self._index), (len(on_disk), len(self._index))

    def info(self) -> dict:
        with self._lock:
            sizes = {"blocks": len(self._index), "bytes": self._bytes, "capacity": self.capacity,
                     "writes_in_flight": len(self._pending), "queued_bytes": self._pending_bytes,
                     "other_identity_blocks": sum(self.other_identities.values())}
        return {**sizes, **asdict(self.stats)}

    # ---- files -------------------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.folder, h[:2], h + ".kv")

    def _tmp_path(self, key: bytes) -> str:
        return f"{self._path(key)}.{os.getpid()}.tmp"

    def _valid(self, key: bytes, data: bytearray) -> bool:
        """Whether a block file's bytes pass every check (and hold a payload)."""
        if len(data) <= HEADER_BYTES:
            return False
        head = memoryview(data)[: _HEADER.size]
        magic, identity, stored_key, size, payload_digest = _HEADER.unpack(head)
        return (magic == _MAGIC and _digest(head) == data[_HEADER.size : HEADER_BYTES] and identity == self.identity
                and stored_key == key and size == len(data) - HEADER_BYTES
                and _digest(memoryview(data)[HEADER_BYTES:]) == payload_digest)

    def _write_file(self, key: bytes, payload: bytes | memoryview) -> None:
        """Write one block under a temporary name, then rename it into place."""
        head = _HEADER.pack(_MAGIC, self.identity, key, len(payload), _digest(payload))
        path, tmp = self._path(key), self._tmp_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(head + _digest(head))
            f.write(payload)
        os.replace(tmp, path)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, payload, ready = item
            size = HEADER_BYTES + payload.numel() * payload.element_size()
            try:
                with self._lock:  # room first: the folder never holds more than capacity
                    self._make_room(size)
                self._write_file(key, memoryview(_landed(payload, ready).view(-1).view(torch.uint8).numpy()))
                with self._lock:
                    self._index[key] = size
                    self._bytes += size
                self.stats.blocks_written += 1
                self.stats.bytes_written += size
            except Exception as e:  # noqa: BLE001 - a failed write loses a block, never the server
                self.stats.writes_failed += 1
                if "write" in self._warned:
                    log.warning("KV tier: writing a block failed again (%d so far): %s", self.stats.writes_failed, e)
                else:
                    self._warned.add("write")
                    log.exception("KV tier: writing a block failed (counted in writes_failed)")
                for path in (self._path(key), self._tmp_path(key)):  # whatever it left (a crash leaves it to _scan)
                    _remove(path)
            finally:
                with self._lock:
                    del self._pending[key]
                    self._pending_bytes -= size
                self._queue.task_done()

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def _others(self, root: str) -> dict[str, int]:
        """Blocks in `root` under identities other than this one's, by their identity's text."""
        others = {}
        for name in os.listdir(root):
            folder = os.path.join(root, name)
            if folder == self.folder or not os.path.isdir(folder):
                continue
            blocks = sum(len(os.listdir(os.path.join(folder, sub))) for sub in os.listdir(folder)
                         if os.path.isdir(os.path.join(folder, sub)))
            if blocks:
                try:
                    with open(os.path.join(folder, _IDENTITY_FILE)) as f:
                        text = f.read().strip()
                except OSError:
                    text = f"unknown ({name})"
                others[text] = others.get(text, 0) + blocks
        return others

    def _make_room(self, size: int) -> None:
        """Delete least recently used blocks until `size` more bytes fit (lock held)."""
        while self._index and self._bytes + size > self.capacity:
            key, old = self._index.popitem(last=False)
            self._bytes -= old
            self.stats.blocks_dropped += 1
            _remove(self._path(key))

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        _remove(self._path(key))

    def _scan(self) -> None:
        """Index the blocks a previous run left (least recently written first); temporary files
        of writes a crash interrupted are deleted."""
        found = []
        for sub in os.listdir(self.folder):
            folder = os.path.join(self.folder, sub)
            if not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                try:
                    key = bytes.fromhex(name.removesuffix(".kv")) if name.endswith(".kv") else None
                except ValueError:
                    key = None
                if key is None:  # a write a crash interrupted, or not ours
                    _remove(path)
                    continue
                st = os.stat(path)
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        with self._lock:
            self._make_room(0)


def _landed(payload: torch.Tensor, ready: Any) -> torch.Tensor:
    """`payload` once its copy from the device has landed."""
    if ready is not None:
        ready.synchronize()
    return payload


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # a folder we may not write: the file stays (it is never read as KV)
        log.warning("KV tier: could not delete %s: %s", path, e)


class KVTier:
    """The tier as the KV manager uses it: the pools' KV (the model's, and a draft model's when
    there is one) of whole blocks of a sequence, saved from slots and loaded into slots."""

    def __init__(self, store: FileTier, pools: list[KVPool], block_tokens: int) -> None:
        self.store = store
        self.pools = pools
        self.block_tokens = block_tokens
        self.dtype = pools[0].k_heads[0].dtype

    def save(self, tokens: Sequence[int], slots: torch.Tensor, start: int) -> None:
        """Queue the blocks of `tokens` that end past position `start` and that the tier lacks
        (token i's KV is in slots[i])."""
        B = self.block_tokens
        for i, key in enumerate(block_keys(tokens, B)):
            end = (i + 1) * B
            if end > start and not self.store.contains(key):
                block = slots[end - B : end]
                self.store.put(key, *host_copy(torch.cat([pool.gather(block).reshape(-1) for pool in self.pools])))

    def load(self, tokens: Sequence[int], cached: int) -> list[torch.Tensor]:
        """The blocks that continue `tokens[:cached]` (the first may begin before `cached`), as
        many as the tier has in a row, up to the last whole block of `tokens`."""
        B = self.block_tokens
        first = cached // B
        keys = block_keys(tokens, B)[first:]
        return self.store.read_leading(keys) if keys else []

    def scatter(self, slots: torch.Tensor, blocks: list[torch.Tensor], skip: int) -> None:
        """Write the KV of `blocks` into `slots`, less the first `skip` tokens of the first block
        (those are in the pool already)."""
        B = self.block_tokens
        parts = []
        for block in blocks:
            flat, at = block.view(self.dtype), 0
            per_pool = []
            for pool in self.pools:
                shape = pool.token_shape()
                n = shape[0] * shape[1] * shape[2] * B
                per_pool.append(flat[at : at + n].view(shape[0], shape[1], B, shape[2]))
                at += n
            parts.append(per_pool)
        for p, pool in enumerate(self.pools):
            data = torch.cat([blocks_kv[p] for blocks_kv in parts], dim=2)[:, :, skip:]
            pool.scatter(slots, data)
