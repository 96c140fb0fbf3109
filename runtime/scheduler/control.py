"""The runtime's control operations on a scheduler and its worker: LoRA adapters loaded and
unloaded, weights updated, the prefix cache flushed, and the debug views (server info, the KV
accounting check, the dashboard). One path for both homes of a scheduler: the scheduler process
answers `ControlRequest`s with it (`answer`), LocalEngine's methods call it.

The served adapters have one owner: the worker's table (`ModelWorker.loras`), changed only here,
and only between steps (a step in flight is taken back first: a step reads the adapters' stacked
pairs while it runs). The scheduler checks each request's adapter against the same table when
it takes the request (`Scheduler.add_request`), so nothing else keeps a copy.

Operations that change something answer a `Reply`: {"success", "message"} and, on failure, the
HTTP-like "status" the server answers with.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from radixlm.runtime.model_config import ModelSource
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.worker.lora import LoraError

log = logging.getLogger(__name__)

Reply = dict[str, Any]


def _done(message: str) -> Reply:
    return {"success": True, "message": message}


def _refused(message: str, status: int = 400) -> Reply:
    return {"success": False, "message": message, "status": status}


class Control:
    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        """`model_name`: the name the served model answers to (an adapter may not take it). The
        adapters given at start (`--lora-paths`) are loaded here; one that cannot be served
        raises LoraError (naming why) and the start fails."""
        self.scheduler = scheduler
        self.worker = scheduler.worker
        self.model_name = model_name
        self.update: ModelSource | None = None  # a weight update waiting for the running requests
        for name, path in scheduler.args.lora_adapters():
            reply = self.load_lora(name, path)
            if not reply["success"]:
                raise LoraError(reply["message"])

    # ---- LoRA adapters -----------------------------------------------------------------------

    def adapters(self) -> dict[str, str]:
        """The adapters served, by name: name -> the folder each was read from."""
        return {name: self.worker.loras[name].path for name in sorted(self.worker.loras)}

    def load_lora(self, name: Any, path: Any) -> Reply:
        """Serve the PEFT adapter at `path` as `name`. Whatever goes wrong reading it is this
        call's 400 (lora.LoraError's message, or the exception's), and what is served stays as
        it was."""
        if not isinstance(name, str) or not name:
            return _refused(f"{name!r} cannot name an adapter: give a non-empty string")
        if name == self.model_name or name in self.worker.loras:
            what = "the served model" if name == self.model_name else "an adapter already loaded"
            return _refused(f"the name {name!r} is taken by {what}: give the adapter another name")
        self.scheduler.settle()
        try:
            self.worker.load_lora(name, path)
        except LoraError as e:
            return _refused(str(e))
        except Exception as e:  # noqa: BLE001 - any file can be put where an adapter is expected
            log.warning("loading adapter %r from %r failed", name, path, exc_info=e)
            return _refused(f"adapter {name!r} could not be read from {path!r}: {type(e).__name__}: {e}")
        return _done(f"adapter {name!r} loaded")

    def unload_lora(self, name: Any) -> Reply:
        """Stop serving adapter `name`: refused (409) while requests not yet ended name it. A
        later adapter of that name shares nothing cached with it."""
        if name not in self.worker.loras:
            return _refused(f"no adapter named {name!r} is loaded")
        users = self.scheduler.lora_users(name)
        if users:
            return _refused(f"adapter {name!r} is in use by {users} request(s): unload it once they end", 409)
        self.scheduler.settle()
        self.worker.unload_lora(name)
        self.scheduler.kv.retire_lora_namespace(name)
        return _done(f"adapter {name!r} unloaded")

    # ---- weights and the cache ---------------------------------------------------------------

    def flush_cache(self) -> Reply:
        if not self.scheduler.flush_cache():
            return _refused("cannot flush the cache while requests are running", 409)
        return _done("cache flushed")

    def begin_update(self, path: Any, abort_all: bool = False) -> Reply | None:
        """/update_weights_from_disk: the checkpoint checked now (a bad one is refused at once:
        the reply); then, as SGLang does, the running requests finish on the old weights (or,
        with `abort_all`, are aborted) while new ones wait, and the update is made once none
        runs (`finish_update`, when `update_ready`). None: accepted, the reply comes then."""
        if self.update is not None:
            return _refused("another weight update is in progress", 409)
        try:
            source = self.worker.check_update(path)
        except ValueError as e:
            return _refused(str(e))
        if abort_all:
            self.scheduler.abort_all()
        self.scheduler.admission_paused = True
        self.update = source
        return None

    @property
    def update_ready(self) -> bool:
        """Whether a weight update waits and no request holds KV any more."""
        return self.update is not None and not self.scheduler.busy

    def finish_update(self) -> Reply:
        source, self.update = self.update, None
        try:
            self.scheduler.update_weights(source)
        except Exception as e:  # noqa: BLE001 - the old weights serve on; the caller learns why
            self.scheduler.admission_paused = False
            error_id = uuid.uuid4().hex[:12]
            log.exception("updating the weights from %s failed (error id %s)", source.path, error_id)
            return _refused(f"loading {source.path} failed: {type(e).__name__}: {e} (error id {error_id}); "
                            "the old weights serve on", 500)
        return _done(f"serving the weights of {source.path}")

    # ---- the views ---------------------------------------------------------------------------

    def answer(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A `ControlRequest`'s answer (all but update_weights, whose answer waits: `begin_update`)."""
        if op == "load_lora":
            return self.load_lora(args.get("lora_name"), args.get("lora_path"))
        if op == "unload_lora":
            return self.unload_lora(args.get("lora_name"))
        if op == "lora_adapters":
            return {"adapters": self.adapters()}
        if op == "flush_cache":
            return self.flush_cache()
        if op == "server_info":
            return self.server_info()
        if op == "check_accounting":
            return self.check_accounting()
        if op == "dashboard":
            return self.dashboard(args.get("since"))
        return {"error": f"unknown control op {op!r}"}

    def server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "running_requests": len(s.running), "waiting_requests": len(s.waiting),
            "kv_pool_tokens": s.kv.num_pages * s.kv.page_size, "page_size": s.kv.page_size,
            "free_tokens": s.kv.allocator.num_free_pages * s.kv.page_size,
            "cached_tokens": (s.kv.cache.evictable_pages + s.kv.cache.locked_pages) * s.kv.page_size,
            # sliding-window models: tokens whose sliding layers' K/V are held (the rest: global layers only)
            "window_tokens": s.kv.window_bound_tokens,
            "num_retractions": s.num_retractions,
            "overlap_schedule": s.overlap, "overlapped_steps": s.overlapped_steps,
            "context_length": s.context_length,
            "speculative_stats": s.speculator.stats() if s.speculator is not None else None,
            "kv_tier": s.kv.tier.store.info() if s.kv.tier is not None else None,
            "lora_adapters": sorted(self.worker.loras),
            **s.worker.weights_info(), **s.worker.kv_info(),
        }

    def check_accounting(self) -> dict[str, Any]:
        """The KV accounting check (tests call it after every workload), and where things stand."""
        s = self.scheduler
        try:
            s.check_accounting()
        except AssertionError as e:
            return {"ok": False, "error": str(e)}
        kv = s.kv
        return {"ok": True, "idle": not s.has_work, "locked_pages": kv.cache.locked_pages,
                "free_pages": kv.allocator.num_free_pages, "evictable_pages": kv.cache.evictable_pages,
                "pool_pages": kv.num_pages, "live": self._live_requests()}

    def dashboard(self, since: float | None, max_nodes: int = 64, text_tokens: int = 64) -> dict[str, Any]:
        """What the live view shows: the queues, the latest step, the KV pages by state, the step
        log after `since` (step_log.py), and the radix tree's largest prefixes (each node's first
        `text_tokens` tokens decoded), taken now."""
        s, kv = self.scheduler, self.scheduler.kv
        free, evictable, locked = kv.allocator.num_free_pages, kv.cache.evictable_pages, kv.cache.locked_pages
        tree = kv.cache.snapshot(max_nodes, text_tokens)
        if s.decode is not None:
            stack = [tree]
            while stack:
                node = stack.pop()
                node["head_text"] = s.decode(node["head"])
                stack.extend(node["children"])
        return {"running_requests": len(s.running), "waiting_requests": len(s.waiting),
                "pending_requests": len(s.pending), "chunked_request": s.chunked is not None,
                **s.step_log.activity(), **s.step_log.history(since),
                "page_size": kv.page_size, "pool_pages": kv.num_pages, "free_pages": free,
                "evictable_pages": evictable, "locked_pages": locked,
                "request_pages": kv.num_pages - free - evictable - locked, "tree": tree}

    def _live_requests(self, limit: int = 8) -> list[dict[str, Any]]:
        """Where the requests in flight stand (the first `limit`), so a check that finds the
        scheduler busy can say with what."""
        s = self.scheduler
        where = [("chunked", [s.chunked] if s.chunked is not None else []), ("running", s.running),
                 ("waiting", s.waiting), ("pending", s.pending)]
        return [{"rid": r.rid, "where": name, "prompt_tokens": len(r.prompt_ids),
                 "output_tokens": len(r.output_ids), "max_new_tokens": r.params.max_new_tokens}
                for name, reqs in where for r in reqs][:limit]
