"""The KV cache's second tier (`--kv-tier-path`) without a model.

The store (`FileTier`) against its contract: keys chained over the whole prefix, another model's
files never read, torn and damaged files detected and deleted, LRU under capacity, a restart
finding what was written. Then the tier under the KV manager, as a property: a pool of one layer
whose "KV" for a token is a function of the token's whole prefix, so any slot holding the wrong
prefix's KV is seen; random workloads through a tiny pool, with writes that fail or tear and
restarts drawn among them.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings, target
from hypothesis import strategies as st

from radixlm.runtime.cache.kv_pool import KVPool, ReqToTokenTable
from radixlm.runtime.cache.kv_tier import HEADER_BYTES, FileTier, KVTier, block_keys
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.kv_manager import KVManager
from radixlm.runtime.scheduler.req import Req


def _payload(seed: int, n: int = 256) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + seed


def test_a_block_key_names_every_token_before_it():
    a = list(range(300))
    b = a[:100] + [7] + a[101:]
    ka, kb = block_keys(a, 64), block_keys(b, 64)
    assert len(ka) == 4  # whole blocks only
    assert ka[0] == kb[0]  # the first block lies wholly before the change
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))  # every block from the changed one on differs
    assert block_keys(a[:200], 64) == ka[:3]  # a prefix's keys are the longer sequence's first keys


def test_blocks_are_read_back_after_a_restart_and_never_by_another_model(tmp_path):
    tier = FileTier(str(tmp_path), "model A", 1 << 20)
    tier.put(b"k" * 32, _payload(1))
    assert tier.contains(b"k" * 32)  # queued counts: it can be read before it reaches the disk
    tier.close()
    again = FileTier(str(tmp_path), "model A", 1 << 20)
    assert torch.equal(again.read(b"k" * 32).view(torch.float32), _payload(1))
    other = FileTier(str(tmp_path), "model B", 1 << 20)
    assert other.read(b"k" * 32) is None and not other.contains(b"k" * 32)
    # even a file of A's copied into B's folder is refused: its header names A
    sub = os.path.join(other.folder, (b"k" * 32).hex()[:2])
    os.makedirs(sub)
    src = again._path(b"k" * 32)
    with open(src, "rb") as f, open(os.path.join(sub, os.path.basename(src)), "wb") as g:
        g.write(f.read())
    moved = FileTier(str(tmp_path), "model B", 1 << 20)
    assert moved.read(b"k" * 32) is None and moved.stats.corrupt_skipped == 1
    for t in (again, other, moved):
        t.close()


@pytest.mark.parametrize("damage", ["truncated", "payload bit", "header bit", "empty"])
def test_a_damaged_file_is_detected_deleted_and_never_read(tmp_path, damage):
    key = bytes(range(32))
    tier = FileTier(str(tmp_path), "m", 1 << 20)
    tier.put(key, _payload(3))
    tier.close()
    path = tier._path(key)
    data = bytearray(open(path, "rb").read())
    if damage == "truncated":
        data = data[: len(data) - 7]
    elif damage == "payload bit":
        data[HEADER_BYTES + 100] ^= 1
    elif damage == "header bit":
        data[40] ^= 1
    else:
        data = bytearray()
    open(path, "wb").write(data)
    again = FileTier(str(tmp_path), "m", 1 << 20)
    assert again.read(key) is None
    assert again.stats.corrupt_skipped == 1 and not os.path.exists(path)
    again.check()
    again.close()


def _torn(tier: FileTier, key: bytes, tmp: str | None = None) -> None:
    """What a write that died midway leaves: a temporary file, and (on a file system whose
    renames are not atomic) part of the bytes under the real name."""
    path = tier._path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(tmp or f"{path}.123.tmp", "wb").write(b"x" * 10)
    open(path, "wb").write(b"y" * (HEADER_BYTES + 10))


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    tier = FileTier(str(tmp_path), "m", 1 << 20)

    def failing(self, key, payload):
        _torn(self, key, self._tmp_path(key))
        raise OSError("disk full")

    monkeypatch.setattr(FileTier, "_write_file", failing)
    tier.put(b"a" * 32, _payload(1))
    tier.drain()
    assert tier.stats.writes_failed == 1 and not tier.contains(b"a" * 32)
    tier.check()
    assert not os.path.exists(tier._path(b"a" * 32)) and not os.path.exists(tier._tmp_path(b"a" * 32))
    tier.close()


def test_failed_writes_are_counted_logged_once_and_on_metrics(tmp_path, monkeypatch, caplog):
    """A failing disk is visible: every failure counted (and exported), the first logged with its
    traceback, the later ones a line each (it was a traceback each, and not on /metrics)."""
    from radixlm.runtime.server.metrics import Metrics

    tier = FileTier(str(tmp_path), "m", 1 << 20)
    monkeypatch.setattr(FileTier, "_write_file", lambda self, key, payload: (_ for _ in ()).throw(OSError("disk full")))
    for i in range(3):
        tier.put(bytes([i]) * 32, _payload(i))
    tier.drain()
    failed = [r for r in caplog.records if "writing a block failed" in r.getMessage()]
    assert [bool(r.exc_info) for r in failed] == [True, False, False]
    assert tier.info()["writes_failed"] == 3
    scraped = Metrics().render({"kv_tier": tier.info()}).decode()
    assert "radixlm_kv_tier_writes_failed 3.0" in scraped and "radixlm_kv_tier_writes_dropped 0.0" in scraped
    tier.close()


def test_the_write_queue_is_bounded_and_drops_with_a_count(tmp_path, monkeypatch, caplog):
    """Evictions faster than the disk: blocks queue up to max_queued_bytes, the rest are not saved
    (counted, one warning); host memory does not grow without bound."""
    size = HEADER_BYTES + 256 * 4
    gate, real = threading.Event(), FileTier._write_file

    def slow(self, key, payload):
        gate.wait(timeout=30)
        real(self, key, payload)

    monkeypatch.setattr(FileTier, "_write_file", slow)
    tier = FileTier(str(tmp_path), "m", 1 << 20, max_queued_bytes=2 * size)
    for i in range(5):
        tier.put(bytes([i]) * 32, _payload(i))
        tier.check()
    info = tier.info()
    assert info["writes_in_flight"] == 2 and info["queued_bytes"] == 2 * size and info["writes_dropped"] == 3
    assert sum("write queue is full" in r.getMessage() for r in caplog.records) == 1
    gate.set()
    tier.drain()
    assert tier.stats.blocks_written == 2 and [tier.contains(bytes([i]) * 32) for i in range(5)] == [True, True] + [False] * 3
    tier.check()
    tier.check_files()
    tier.close()


def test_a_folder_of_other_configurations_blocks_says_so_at_start(tmp_path, caplog):
    """After a restart that changed the model, its precision, page or block size, the tier starts
    cold: it says so (the log, and info() for /get_server_info and /metrics) instead of silently
    reading cached_tokens 0."""
    a = FileTier(str(tmp_path), "model A;precision=int4", 1 << 20)
    a.put(b"k" * 32, _payload(1))
    a.close()
    b = FileTier(str(tmp_path), "model A;precision=none", 1 << 20)
    [warning] = [r.getMessage() for r in caplog.records if "other configurations" in r.getMessage()]
    assert "1 blocks" in warning and "model A;precision=int4" in warning and "model A;precision=none" in warning
    assert b.info()["other_identity_blocks"] == 1 and b.info()["blocks"] == 0
    b.put(b"j" * 32, _payload(2))
    b.close()
    caplog.clear()
    again = FileTier(str(tmp_path), "model A;precision=none", 1 << 20)  # it has blocks of its own now: no warning
    assert not [r for r in caplog.records if "other configurations" in r.getMessage()]
    assert again.info()["other_identity_blocks"] == 1 and again.info()["blocks"] == 1
    again.check_files()
    again.close()


def test_a_crash_mid_write_leaves_nothing_readable(tmp_path):
    """A process that died mid-write: its temporary file is deleted at the next start, the torn
    file under the real name fails its checks when read and is deleted. Neither is read as KV."""
    tier = FileTier(str(tmp_path), "m", 1 << 20)
    tier.close()
    _torn(tier, b"a" * 32)
    again = FileTier(str(tmp_path), "m", 1 << 20)
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(again.folder) for name in files)
    assert again.contains(b"a" * 32) and again.read(b"a" * 32) is None and again.stats.corrupt_skipped == 1
    again.check_files()
    again.close()


def test_the_folder_stays_under_capacity_least_recently_used_first(tmp_path):
    size = HEADER_BYTES + 256 * 4
    tier = FileTier(str(tmp_path), "m", 3 * size)
    for i in range(3):
        tier.put(bytes([i]) * 32, _payload(i))
    tier.drain()
    assert tier.read(bytes([0]) * 32) is not None  # 0 is now the most recently used
    tier.put(bytes([3]) * 32, _payload(3))
    tier.drain()
    assert [tier.contains(bytes([i]) * 32) for i in range(4)] == [True, False, True, True]
    assert tier.info()["bytes"] == 3 * size and tier.stats.blocks_dropped == 1
    tier.put(b"z" * 32, _payload(0, n=4096))  # larger than the whole tier: not kept
    tier.drain()
    assert not tier.contains(b"z" * 32)
    tier.check()
    tier.check_files()
    tier.close()
    smaller = FileTier(str(tmp_path), "m", 2 * size)  # restarted with less room: the oldest go
    assert smaller.info()["blocks"] == 2
    smaller.check_files()
    smaller.close()


# ---- the tier under the KV manager ---------------------------------------------------------

BLOCK = 4
PAGE = 2


def _kv_value(prefix: tuple[int, ...]) -> float:
    """The stand-in "KV" of a token: a function of every token up to and including it."""
    return float(hash(prefix) % (1 << 20))


class World:
    """A KV manager over a one-layer pool and a tier, restartable (the pool is lost, the folder kept)."""

    def __init__(self, folder: str, pages: int, fail: list[bool]) -> None:
        self.folder, self.pages, self.fail = folder, pages, fail
        self.start()

    def start(self) -> None:
        self.pool = KVPool(1, self.pages * PAGE, 1, 1, torch.float32, "cpu")
        table = ReqToTokenTable(4, 512, "cpu")
        store = FileTier(self.folder, "property", 1 << 30)
        original = store._write_file

        def write(key, payload):  # a drawn share of writes fail halfway
            if self.fail and self.fail.pop():
                _torn(store, key, store._tmp_path(key))
                raise OSError("injected failure")
            original(key, payload)

        store._write_file = write
        self.kv = KVManager(self.pages, PAGE, table, True, torch.device("cpu"), tier=KVTier(store, [self.pool], BLOCK))

    def restart(self, torn: list[bytes]) -> None:
        """A restart after a crash that left the blocks `torn` half written."""
        self.kv.shutdown()
        for key in torn:
            _torn(self.kv.tier.store, key)
        self.start()

    def run(self, tokens: list[int]) -> int:
        """One request: admit, read what the tier has, "prefill" the rest, check every slot, cache."""
        req = Req(TokenizedRequest(rid="r", input_ids=tokens, sampling_params=SamplingParams(max_new_tokens=1)), 0)
        kv = self.kv
        kv.admit(req)
        if kv.pages_to_extend(req, req.seq_len - req.cached_len) > kv.available_pages:
            kv.undo_admit(req)
            return -1
        loaded = kv.load_from_tier(req)
        start = req.cached_len
        slots = kv.extend_slots(req, req.seq_len - start)
        values = torch.tensor([_kv_value(tuple(tokens[: i + 1])) for i in range(start, req.seq_len)])
        self.pool.k_heads[0][0, slots, 0] = values
        self.pool.v_heads[0][0, slots, 0] = -values
        req.cached_len = req.seq_len
        all_slots = kv.table.table[req.row, : req.seq_len]
        want = torch.tensor([_kv_value(tuple(tokens[: i + 1])) for i in range(req.seq_len)])
        assert torch.equal(self.pool.k_heads[0][0, all_slots, 0], want), "a slot holds another prefix's K"
        assert torch.equal(self.pool.v_heads[0][0, all_slots, 0], -want), "a slot holds another prefix's V"
        kv.release(req)
        kv.check_accounting([])
        return loaded


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=25),
       st.lists(st.booleans(), max_size=30), st.lists(st.integers(0, 24), max_size=3))
def test_random_workloads_never_read_a_wrong_prefix(tmp_path_factory, requests, fail, restarts):
    """Requests share one of four stems, then go their own way; the pool holds 40 tokens, so the
    tree evicts all the time and the tier serves what it evicted, across restarts after crashes
    that tore blocks of the stems, whatever writes failed."""
    world = World(str(tmp_path_factory.mktemp("tier")), pages=20, fail=list(fail))
    stems = [[s] * 8 + list(range(10 * s, 10 * s + 30)) for s in range(4)]
    loaded = 0
    for i, (stem, length, tail) in enumerate(requests):
        if i in restarts:
            world.restart(torn=[block_keys(stems[(i + j) % 4], BLOCK)[j] for j in range(3)])
        tokens = (stems[stem] + [100 + tail] * 40)[:length]
        got = world.run(tokens)
        loaded += max(got, 0)
        world.kv.tier.store.drain()
        world.kv.tier.store.check()
    world.kv.shutdown()
    world.kv.tier.store.check_files()
    target(float(loaded))  # steer towards workloads the tier serves much of


def test_an_evicted_prefix_comes_back_from_the_tier(tmp_path):
    world = World(str(tmp_path), pages=20, fail=[])
    a, b = list(range(1, 36)), list(range(50, 85))
    assert world.run(a) == 0
    world.kv.tier.store.drain()
    assert world.run(b) == 0  # evicts a's pages: they were saved
    world.kv.tier.store.drain()
    assert world.run(a) == 32  # a's whole blocks (8 of 4 tokens; the last token is always computed)
    world.restart(torn=[])
    assert world.run(b) == 32
    world.kv.shutdown()
