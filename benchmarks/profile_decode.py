"""Where a decode step of our engine spends its time: torch.profiler over a few steps.

The batch is one of the offline benchmark's workloads: random (64 requests of
90-110 prompt tokens) or shared-prefix (64 requests of ~1,020 tokens, the first
1,000 shared), or run_all's no-sharing requests (ShareGPT-like log-normal
prompt lengths, 8 to 1,024 tokens). All of it is prefilled first, a few decode steps run unprofiled to
warm up, then `--steps` decode steps are profiled and the top ops by self CPU time printed.

    python benchmarks/profile_decode.py [--workload random|shared-prefix|no-sharing] [--steps 8] [--requests 64] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`

from offline_throughput import FULL, random_workload, shared_prefix_workload, token_pool  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.messages import TokenizedRequest  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from workloads import no_sharing  # noqa: E402

WARMUP_STEPS = 3


def start_decoding(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> None:
    """Submit every prompt and step until all are prefilled and decoding."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for ids in prompts:
        engine.scheduler.add_request(TokenizedRequest(uuid.uuid4().hex, ids, params))
    sched = engine.scheduler
    while sched.waiting or sched.chunked is not None:
        sched.step()
    for _ in range(WARMUP_STEPS):
        sched.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("random", "shared-prefix", "no-sharing"), default="random")
    parser.add_argument("--steps", type=int, default=8, help="decode steps to profile")
    parser.add_argument("--requests", type=int, default=FULL.requests, help="requests decoding together")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)

    engine = LocalEngine(None, max_total_tokens=32768)
    if cli.workload == "no-sharing":
        prompts = [ids for ids, _ in no_sharing(cli.requests).requests]
    else:
        make = random_workload if cli.workload == "random" else shared_prefix_workload
        prompts = make(token_pool(engine.tokenizer), FULL).prompts[: cli.requests]
    # enough new tokens that no request finishes inside the profiled window
    start_decoding(engine, prompts, new_tokens=WARMUP_STEPS + cli.steps + 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(cli.steps):
            engine.scheduler.step()
        wall = time.perf_counter() - start
    lens = sorted(map(len, prompts))
    print(f"{cli.workload}: {cli.steps} decode steps of {len(prompts)} requests (prompts {lens[0]}-{lens[-1]}, "
          f"median {lens[len(lens) // 2]}), {cli.threads} threads: "
          f"{1000 * wall / cli.steps:.1f} ms/step under the profiler")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
