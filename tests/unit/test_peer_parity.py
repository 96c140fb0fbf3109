"""Where the runtime's side of the OpenAI endpoints differed from SGLang (issue 32, found by the peers'
API test suites): stop token ids past the vocabulary, logit_bias errors that named one bad entry,
and SGLang's `continue_final_message` (the assistant's last message continued, not closed)."""

from __future__ import annotations

import pytest

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.sampling_params import SamplingParams, SamplingParamsError
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest
from radixlm.runtime.tokenizer.loader import chat_prompt
from radixlm.runtime.tokenizer.prepare import RequestPreparer

V = 49152  # SmolLM2's vocabulary


def test_stop_token_ids_past_the_vocabulary_are_accepted_and_dropped(smol_tokenizer):
    prep = RequestPreparer(smol_tokenizer, V, 64, 256)
    params = {"stop_token_ids": [V + 5, 2, 10**9], "min_new_tokens": 1, "max_new_tokens": 4}
    tr = prep.prepare(GenerateRequest("r", input_ids=[1, 2], sampling_params=params))
    # dropped, as they can never be sampled (the min_new_tokens block indexes the logits by them)
    assert tr.sampling_params.stop_token_ids == [2]
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):  # a negative id is still no token id
        prep.prepare(GenerateRequest("r", input_ids=[1, 2], sampling_params={"stop_token_ids": [-1]}))


def test_logit_bias_errors_name_every_bad_entry():
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams.from_dict({"logit_bias": {"a": 1, "5": 1, "b": 1}})
    assert "'a'" in str(caught.value) and "'b'" in str(caught.value)
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(logit_bias={V: 1.0, 3: 1.0, V + 1: 1.0}).validate(V)
    assert f"{V}, {V + 1}" in str(caught.value)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValueError) as caught:
        ChatCompletionRequest.model_validate(chat | {"logit_bias": {"x": 1, "y": 1}})
    assert "'x'" in str(caught.value) and "'y'" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        ChatCompletionRequest.model_validate(chat | {"logit_bias": {"1": 101, "2": -101}})
    assert "logit_bias[1]" in str(caught.value) and "logit_bias[2]" in str(caught.value)


CONVERSATION = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3"}]


def test_continue_final_message_leaves_the_assistant_turn_open(smol_tokenizer):
    closed = chat_prompt(smol_tokenizer, CONVERSATION)
    assert closed.endswith("1, 2, 3<|im_end|>\n<|im_start|>assistant\n")  # a new turn opened after it
    prefilled = chat_prompt(smol_tokenizer, CONVERSATION, template_kwargs={"continue_final_message": True})
    assert prefilled.endswith("<|im_start|>assistant\n1, 2, 3") and closed.startswith(prefilled)
    # after any other role it changes nothing (SGLang ignores it there)
    asked = CONVERSATION[:1]
    assert chat_prompt(smol_tokenizer, asked, template_kwargs={"continue_final_message": True}) == \
        chat_prompt(smol_tokenizer, asked)
    with pytest.raises(ValueError, match="must be a boolean"):
        chat_prompt(smol_tokenizer, CONVERSATION, template_kwargs={"continue_final_message": "yes"})


def test_a_system_message_past_the_first_stays_where_it_stands_or_joins_the_first():
    """System turns among the messages (Claude Code sends them to the Messages API; vLLM and SGLang
    take them): kept in place where the template takes them (Qwen3's), so the conversation before
    them is the prefix the radix cache holds; joined, in order, into the first where the template
    takes a system message only first (Qwen3.5's raises, as vLLM's and SGLang's probes find)."""
    from tiny_qwen3 import make_tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Plan mode is off."}, {"role": "user", "content": "Go"}]
    tok = make_tokenizer()
    assert chat_prompt(tok, messages).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nPlan mode is off.<|im_end|>\n"
        "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                         "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                         "[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    assert chat_prompt(tok, messages) == "[system] Be brief.\n\nPlan mode is off.\n[user] Hi\n[user] Go\n[assistant]"
    assert chat_prompt(tok, messages[1:]) == "[system] Plan mode is off.\n[user] Hi\n[user] Go\n[assistant]"
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate.') }}"  # another refusal is still one
    with pytest.raises(ValueError, match="cannot apply the chat template: Conversation roles must alternate"):
        chat_prompt(tok, messages)
