"""The native API's request fields and stream shapes, on the app alone: a stand-in client plays
the runtime, so each shape is checked against outputs written here by hand."""

from __future__ import annotations

import orjson
import pytest
from fastapi.testclient import TestClient

from radixlm.runtime.messages import ClientOutput
from radixlm.runtime.native import UNSUPPORTED_FIELDS, native_requests
from radixlm.runtime.server.http_server import ServerState, create_app

# What the runtime sends for one streamed request: new text and ids per output; the third output
# re-encodes the last id sent (jump-forward) as two.
OUTPUTS = [
    ClientOutput("r", "Hel", [1], {"output_token_logprobs": [[-0.5, 1, None]]}),
    ClientOutput("r", "lo", [2], {"output_token_logprobs": [[-0.25, 2, None]]}),
    ClientOutput("r", " world", [7, 8], {"replaced_tokens": 1, "output_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}),
    ClientOutput("r", "!", [9], {"output_token_logprobs": [[0.0, 9, None]], "finish_reason": {"type": "length"}},
                 finished=True),
]


class StandInClient:
    on_finish = None
    seen = []

    async def stream(self, req):
        self.seen.append(req)
        for out in OUTPUTS:
            yield out


def stream(incremental: bool) -> list[dict]:
    state = ServerState(StandInClient(), {}, {"incremental_streaming_output": incremental}, "smol")
    client = TestClient(create_app(state))
    r = client.post("/generate", json={"text": "hi", "stream": True, "return_logprob": True})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_a_native_stream_holds_everything_so_far_as_sglang_streams():
    chunks = stream(incremental=False)
    assert [c["text"] for c in chunks] == ["Hel", "Hello", "Hello world", "Hello world!"]
    assert [c["output_ids"] for c in chunks] == [[1], [1, 2], [1, 7, 8], [1, 7, 8, 9]]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 2, 4, 5]
    assert all("replaced_tokens" not in c["meta_info"] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}


def test_incremental_streaming_output_sends_only_what_is_new():
    chunks = stream(incremental=True)
    assert [c["text"] for c in chunks] == ["Hel", "lo", " world", "!"]
    assert [c["output_ids"] for c in chunks] == [[1], [2], [7, 8], [9]]
    assert chunks[2]["meta_info"]["replaced_tokens"] == 1


def test_sglang_request_fields_reach_the_request():
    body = {"text": ["a", "b"], "rid": ["x", "y"], "return_logprob": [True, False], "logprob_start_len": [0, None],
            "top_logprobs_num": 3, "return_text_in_logprobs": True, "log_metrics": False,
            # what SGLang's clients send unset
            "image_data": None, "lora_path": None, "session_params": None, "return_hidden_states": False,
            "sampling_params": {"max_new_tokens": 4, "stop_regex": [r"\d"], "no_stop_trim": True,
                                "sampling_seed": 5, "stream_interval": 2, "custom_params": {"k": 1}}}
    reqs, single = native_requests(body)
    assert not single and [r.rid for r in reqs] == ["x", "y"]
    assert [(r.return_logprob, r.logprob_start_len, r.top_logprobs_num) for r in reqs] == [(True, 0, 3), (False, -1, 3)]
    assert reqs[0].sampling_params["sampling_seed"] == 5 and reqs[0].return_text_in_logprobs


def test_n_samples_under_sampling_seed_get_their_own_seeds():
    reqs, _ = native_requests({"text": "a", "sampling_params": {"n": 3, "sampling_seed": 11}})
    seeds = [r.sampling_params.get("seed", r.sampling_params.get("sampling_seed")) for r in reqs]
    assert seeds[0] == 11 and len(set(seeds)) == 3


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_each_missing_feature_is_refused_by_name(name):
    state = ServerState(StandInClient(), {}, {}, "smol")
    r = TestClient(create_app(state)).post("/generate", json={"text": "hi", name: "x"})
    assert r.status_code == 400
    assert f"'{name}' is not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"text": ["a", "b"], "return_logprob": [True]}, "one per prompt"),
    ({"text": "a", "logprob_start_len": "0"}, "logprob_start_len"),
    ({"text": "a", "log_metrics": "no"}, "log_metrics"),
    ({"text": "a", "lora_pathx": None}, "unknown field"),
])
def test_malformed_sglang_fields_get_a_400_naming_them(body, fragment):
    state = ServerState(StandInClient(), {}, {}, "smol")
    r = TestClient(create_app(state)).post("/generate", json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_the_documented_body_names_every_sampling_parameter():
    from radixlm.runtime.native import SAMPLING_PARAMS_SCHEMA
    from radixlm.runtime.sampling_params import ALIASES, field_names

    documented = set(SAMPLING_PARAMS_SCHEMA["properties"])
    assert documented == set(field_names()) | set(ALIASES) | {"choices", "choices_method"}
