"""Tensor parallelism over gloo on a CPU: greedy tokens equal HF (and so TP=1) for every TP size,
prompt logprobs agree with TP=1, the ranks split the machine's cores, and a rank that dies takes
the whole group down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from helpers import MODULE_CWD
import torch

from conftest import NEW_TOKENS
from oracle import assert_matches
from radixlm.runtime.cores import parse_cpu_list
from radixlm.runtime.engine import Engine

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


def _children() -> dict[str, int]:
    """This process's children by title (radixlm-sched is rank 0's process, radixlm-tpN rank N's)."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    names = {}
    for pid in map(int, out.split()):
        with open(f"/proc/{pid}/comm") as f:
            names[f.read().strip()] = pid
    return names


def _assert_ranks_split_the_cores(engine: Engine) -> None:
    """On one machine each rank is pinned to its own cores (the kernel's view of each process), as
    it reports, with a torch thread per physical core of them: between them, the cores this
    process may use, each once."""
    pids, placement = _children(), engine.info["placement"]
    cpus = {name: os.sched_getaffinity(pids[title]) for name, title in (("scheduler", "radixlm-sched"),
                                                                         ("tp-rank-1", "radixlm-tp1"))}
    allowed = os.sched_getaffinity(0)
    if len(allowed) >= 2:
        assert not cpus["scheduler"] & cpus["tp-rank-1"] and cpus["scheduler"] | cpus["tp-rank-1"] == allowed, cpus
    else:
        assert cpus["scheduler"] == cpus["tp-rank-1"] == allowed
    with open(f"/sys/devices/system/cpu/cpu{min(allowed)}/topology/thread_siblings_list") as f:
        per_core = len(parse_cpu_list(f.read().strip()))
    for name, mine in cpus.items():
        assert parse_cpu_list(placement[name]["cpus"]) == sorted(mine), (name, placement)
        assert placement[name]["torch_threads"] == max(1, len(mine) // per_core), (name, placement)


def _assert_clean(engine: Engine) -> None:
    acct = engine.check_accounting()
    assert acct["ok"] and acct["idle"] and acct["locked_pages"] == 0, acct
    assert acct["free_pages"] + acct["evictable_pages"] == acct["pool_pages"], acct


# 4 query heads and 2 KV heads: TP=2 splits both; TP=4 replicates each KV head on two ranks
@pytest.mark.parametrize("tp_size", [2, 4])
def test_greedy_tokens_equal_hf_at_every_tp_size(tiny_llama, tp_size):
    with Engine(tiny_llama.path, skip_tokenizer_init=True, tp_size=tp_size, max_total_tokens=8192, page_size=4,
                chunked_prefill_size=24) as engine:
        results = engine.generate(input_ids=tiny_llama.prompts, sampling_params=GREEDY)
        for i, (res, ref) in enumerate(zip(results, tiny_llama.refs)):
            assert_matches(res["output_ids"], ref, f"tp={tp_size} prompt {i}")
        if tp_size == 4:  # (replicated KV heads are what 4 ranks add; the cache across ranks is 2's)
            _assert_clean(engine)
            return
        _assert_ranks_split_the_cores(engine)
        shared = engine.generate(input_ids=tiny_llama.shared_prompts, sampling_params=GREEDY)
        assert sum(r["meta_info"]["cached_tokens"] for r in shared) >= 6 * 64  # the prefix cache works across ranks
        for i, (res, ref) in enumerate(zip(shared, tiny_llama.shared_refs)):
            assert_matches(res["output_ids"], ref, f"tp={tp_size} shared-prefix prompt {i}")
        _assert_clean(engine)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_prompt_logprobs_agree_with_tp1(tiny_llama, kv):
    """Each rank's pool holds its KV heads in the KV type (int8: each head's rows, codes and scale,
    as one rank would store them), so only the all-reduce's order differs from TP=1."""
    prompt = tiny_llama.prompts[2]
    kwargs = dict(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                  logprob_start_len=0, top_logprobs_num=2)
    single = tiny_llama.engine(kv_cache_dtype=kv).generate(**kwargs)["meta_info"]
    with Engine(tiny_llama.path, skip_tokenizer_init=True, tp_size=2, max_total_tokens=4096, kv_cache_dtype=kv) as engine:
        split = engine.generate(**kwargs)["meta_info"]
        info = engine.server_info()
    assert info["kv_cache_dtype"] == ("fp32" if kv == "auto" else kv)  # (a dense checkpoint: exact fp32 serving)
    assert info["kv_bytes_per_token"] == 2 * 2 * 1 * (20 if kv == "int8" else 64)  # rank 0's: 1 of the 2 KV heads
    for key in ("input_token_logprobs", "output_token_logprobs"):
        for (a, tok_a, _), (b, tok_b, _) in zip(single[key][1:], split[key][1:]):
            assert tok_a == tok_b and abs(a - b) < 1e-4, (key, a, b)


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=MODULE_CWD)


def test_two_nodes_over_loopback_equal_hf(tiny_llama):
    """Two 'machines' on one: node 1 runs rank 1 and no API; node 0 the scheduler, rank 0 and the API."""
    from server.conftest import LiveServer, free_port

    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", tiny_llama.path, "--skip-tokenizer-init", "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr]
    node1 = _serve(*common, "--node-rank", "1")
    try:
        node0 = LiveServer(*common, "--node-rank", "0")
        try:
            r = httpx.post(node0.url + "/generate", json={"input_ids": tiny_llama.prompts[:4], "sampling_params": GREEDY},
                           timeout=120)
            assert r.status_code == 200, r.text
            for i, (res, ref) in enumerate(zip(r.json(), tiny_llama.refs)):
                assert_matches(res["output_ids"], ref, f"two nodes, prompt {i}")
        finally:
            assert node0.stop() == 0
        assert node1.wait(30) == 1  # its rank lost node 0: it stops, saying so
        assert "radixlm node 1: tensor-parallel ranks 1-1" in node1.stdout.read()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_a_dead_rank_takes_the_server_down_with_a_named_error(tiny_llama):
    from server.conftest import LiveServer, all_gone

    srv = LiveServer("--model-path", tiny_llama.path, "--skip-tokenizer-init", "--tp-size", "2")
    (follower,) = [p for p in srv.descendant_pids() if open(f"/proc/{p}/comm").read().strip() == "radixlm-tp1"]
    everyone = srv.descendant_pids()
    os.kill(follower, signal.SIGKILL)
    deadline = time.time() + 5
    while srv.proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert srv.proc.poll() is not None, "the server outlived a dead rank by 5 s"
    assert srv.stop() == 1, srv.output()
    assert "tp-rank-1 process" in srv.output()
    assert all_gone(everyone), "processes outlived the server"  # multiprocessing's resource tracker takes a moment


@pytest.mark.parametrize("model,size", [("tiny safetensors", 2), ("SmolLM2 GGUF", 3)])
def test_a_rank_reads_only_its_shards(model, size, request, monkeypatch):
    """Rank 1 reads (safetensors) or dequantizes (GGUF) only its share of each matrix, and its
    shares are the right parts of the whole."""
    import gguf.quants

    from radixlm.runtime.model_config import load_config, resolve_model
    from radixlm.runtime.worker import loader
    from radixlm.runtime.worker.models.llama import ARCHITECTURES
    from radixlm.runtime.worker.parallel import TPContext

    src = resolve_model(request.getfixturevalue("tiny_llama").path if model.startswith("tiny") else None)
    cfg = load_config(src)
    whole = ARCHITECTURES[cfg.architecture](cfg, TPContext())
    whole.load_weights(loader.iter_weights(src, cfg))
    total = sum(p.numel() for p in whole.parameters())
    read: list[int] = []
    original = loader.Weight._read
    monkeypatch.setattr(loader.Weight, "_read", lambda self, t: (read.append(t.numel()), original(self, t))[1])
    dequantized: list[int] = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: (out := dequantize(*a), dequantized.append(out.size))[0])
    rank1 = ARCHITECTURES[cfg.architecture](cfg, TPContext(rank=1, size=size))  # loading needs no process group
    rank1.load_weights(loader.iter_weights(src, cfg))
    share = 1 / size + 0.05  # a share of every matrix, the (small) norms whole
    assert sum(read) < share * total, (sum(read), total)
    assert sum(dequantized) < share * total and bool(dequantized) == src.is_gguf, (sum(dequantized), total)
    down, down1 = whole.layers[0].mlp.down_proj.weight, rank1.layers[0].mlp.down_proj.weight
    cols = down.shape[1] // size
    assert torch.equal(down1, down[:, cols : 2 * cols])
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q1, kv1 = q_rows // size, kv_rows // size
    qkv, qkv1 = whole.layers[1].self_attn.qkv_proj.weight, rank1.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv1[:q1], qkv[q1 : 2 * q1])  # rank 1's query heads
    assert torch.equal(qkv1[q1:], torch.cat([qkv[q_rows + kv1 : q_rows + 2 * kv1],
                                             qkv[q_rows + kv_rows + kv1 : q_rows + kv_rows + 2 * kv1]]))  # its K, V
