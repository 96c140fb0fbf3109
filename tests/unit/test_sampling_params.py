from __future__ import annotations

import json

import pytest

from radixlm.runtime.sampling_params import SamplingParams, SamplingParamsError


def test_none_and_empty_give_defaults() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_null_value_means_default() -> None:
    assert SamplingParams.from_dict({"temperature": None, "stop": None}) == SamplingParams()


def test_unknown_field_is_named_and_allowed_fields_listed() -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({"max_tokens": 5})
    message = str(err.value)
    assert "'max_tokens'" in message
    assert "max_new_tokens" in message and "temperature" in message


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", "abc"),
        ("max_new_tokens", True),
        ("max_new_tokens", 3.5),
        ("top_k", False),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", float("nan")),
        ("ignore_eos", 1),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop_token_ids", "2"),
        ("stop_token_ids", [1, "2"]),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"5": "big"}),
        ("seed", "7"),
        ("regex", 42),
    ],
)
def test_wrong_type_names_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.1),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("n", 0),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {"-3": 1.0}),
    ],
)
def test_out_of_range_names_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams.from_dict({field: value})


def test_min_new_tokens_bounded_by_max_new_tokens() -> None:
    with pytest.raises(SamplingParamsError, match="min_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5})
    SamplingParams.from_dict({"max_new_tokens": 5, "min_new_tokens": 5})


def test_regex_and_json_schema_are_exclusive() -> None:
    with pytest.raises(SamplingParamsError, match="regex"):
        SamplingParams.from_dict({"regex": "a+", "json_schema": "{}"})


def test_json_schema_object_is_carried_as_text() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams.from_dict({"json_schema": schema})
    assert json.loads(params.json_schema) == schema


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams.from_dict({"stop": "\n\n"}).stop == ["\n\n"]
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams.from_dict({"stop": ("a", "b")}).stop == ["a", "b"]


def test_logit_bias_string_keys_normalised_to_int() -> None:
    params = SamplingParams.from_dict({"logit_bias": {"50": 2, "7": -1.5}})
    assert params.logit_bias == {50: 2.0, 7: -1.5}
    assert all(type(k) is int for k in params.logit_bias)
    assert all(type(v) is float for v in params.logit_bias.values())


def test_validate_checks_token_ids_against_vocab() -> None:
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}).validate(vocab_size=10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).validate(vocab_size=10)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate(vocab_size=10)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy


def test_to_dict_round_trips_and_copies() -> None:
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0}, seed=4, temperature=0.5)
    d = params.to_dict()
    assert SamplingParams.from_dict(d) == params
    d["stop"].append("y")
    assert params.stop == ["x"]


def test_sglang_fields_parse():
    p = SamplingParams.from_dict({"stop_regex": r"\d+", "no_stop_trim": True, "sampling_seed": 9, "stream_interval": 4,
                                  "custom_params": {"k": [1, "a"]}, "ebnf": 'root ::= "a"', "beam_width": None})
    assert (p.stop_regex, p.no_stop_trim, p.seed, p.stream_interval) == ([r"\d+"], True, 9, 4)
    assert p.custom_params == {"k": [1, "a"]} and p.ebnf == 'root ::= "a"'
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"seed": 3, "sampling_seed": 3}).seed == 3


@pytest.mark.parametrize("params, fragment", [
    ({"stop_regex": "("}, "not a valid regular expression"),
    ({"stop_regex": ["ok", "x?"]}, "matches the empty string"),
    ({"stop_regex": 5}, "stop_regex must be a string or a list of strings"),
    ({"sampling_seed": 1, "seed": 2}, "disagree"),
    ({"sampling_seed": "1"}, "seed must be an integer"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"no_stop_trim": "yes"}, "no_stop_trim must be a boolean"),
    ({"custom_params": [1]}, "custom_params must be an object"),
    ({"custom_params": {"f": float("nan")}}, "custom_params must be JSON values"),
    ({"beam_width": 4}, "beam_width is not supported"),
    ({"watermark": {"key": 1}}, "watermark is not supported"),
])
def test_sglang_fields_refused_with_the_reason(params, fragment):
    with pytest.raises(SamplingParamsError, match=fragment):
        SamplingParams.from_dict(params)
