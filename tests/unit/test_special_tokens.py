"""Special tokens on a text prompt (issue 47): a text is encoded with its tokenizer's own special
tokens, as HF's `encode`, vLLM's completions and SGLang's /generate encode one (Llama 3's BOS
before it, Qwen3-Embedding's <|endoftext|> after it, which its last-token pooling reads); a chat
rendered by its template gets none beside the template's own (one BOS, as vLLM and SGLang encode
a rendered chat); and /tokenize, choices and a program of the language agree with what is fed."""

from __future__ import annotations

import pytest

import radixlm as rl
from radixlm.lang.chat_template import from_model
from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.tokenizer.choices import scoring_requests
from radixlm.runtime.tokenizer.prepare import RequestPreparer
from tiny_tokenizers import embedding_tokenizer, llama3_tokenizer
from unit.test_frontend import Scripted
from unit.test_request_prepare import _manager

TEXT = "Hello world, the answer is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llama3():
    return llama3_tokenizer()


def _prep(tok) -> RequestPreparer:
    return RequestPreparer(tok, len(tok), 256, 1024)


def test_a_text_prompt_gets_its_tokenizers_special_tokens(llama3):
    bare = llama3.encode(TEXT, add_special_tokens=False)
    assert _prep(llama3).prepare(GenerateRequest("r", text=TEXT)).input_ids == [llama3.bos_token_id, *bare]
    embed = embedding_tokenizer()
    ids = _prep(embed).prepare(GenerateRequest("r", text=TEXT, sampling_params={"max_new_tokens": 0},
                                                embed="last")).input_ids
    assert ids == [*embed.encode(TEXT, add_special_tokens=False), embed.convert_tokens_to_ids("<|endoftext|>")]
    # token ids are fed as they are
    assert _prep(llama3).prepare(GenerateRequest("r", input_ids=bare)).input_ids == bare


def test_smollm2s_tokenizer_adds_none(smol_tokenizer):
    """The default model's tokenizer adds no special token to a text: what the served tests expect
    of SmolLM2 (prompts encoded without them) stays true."""
    assert smol_tokenizer.encode(TEXT) == smol_tokenizer.encode(TEXT, add_special_tokens=False)


def test_a_rendered_chat_has_its_templates_bos_once(llama3):
    ids = _prep(llama3).prepare(GenerateRequest("r", messages=CHAT)).input_ids
    assert ids[0] == llama3.bos_token_id and ids.count(llama3.bos_token_id) == 1


def test_tokenize_agrees_with_what_is_fed(llama3):
    prep = _prep(llama3)
    m = _manager(prep)
    fed = prep.prepare(GenerateRequest("r", text=TEXT)).input_ids
    assert m._tokens("tokenize", {"text": TEXT, "add_special_tokens": True})["input_ids"] == fed
    assert m._tokens("tokenize", {"text": TEXT})["input_ids"] == fed[1:]  # (asked without them)
    chat = prep.prepare(GenerateRequest("r", messages=CHAT)).input_ids
    assert m._tokens("tokenize", {"messages": CHAT})["input_ids"] == chat
    # vLLM's add_generation_prompt false: the conversation as it stands, without the assistant's header
    closed = m._tokens("tokenize", {"messages": CHAT, "add_generation_prompt": False})["input_ids"]
    header = llama3.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    assert closed + header == chat


def test_choices_are_scored_on_the_prompt_as_it_is_fed(llama3):
    prep = _prep(llama3)
    scoring = scoring_requests(prep, GenerateRequest("c", text="Colour:", sampling_params={"choices": [" red", " blue"]}))
    prompt = prep.prepare(GenerateRequest("r", text="Colour:")).input_ids
    for tr, choice in zip(scoring.requests, (" red", " blue")):
        assert tr.input_ids == prep.encode("Colour:" + choice) and tr.input_ids.count(llama3.bos_token_id) == 1
        assert tr.input_ids[: tr.logprob_start_len] == prompt[: tr.logprob_start_len]
        assert tr.logprob_start_len >= len(prompt) - 1  # (the prompt's last token may merge with the choice)


def test_a_program_on_llama3_is_fed_one_bos(llama3):
    """The language writes Llama 3's turns but leaves its BOS to the runtime, which adds it to every
    text (as SGLang's frontend does): a program's prompt holds one."""
    backend = Scripted("Paris", template=from_model(llama3.chat_template, llama3.bos_token))

    @rl.function
    def ask(s):
        s += rl.user(CHAT[0]["content"])
        s += rl.assistant(rl.gen("a", max_tokens=4))

    ask.run(backend=backend)
    text = backend.bodies[0]["text"]
    ids = _prep(llama3).prepare(GenerateRequest("r", text=text)).input_ids
    assert ids.count(llama3.bos_token_id) == 1
    # the model's own template renders the same prompt
    assert ids == _prep(llama3).prepare(GenerateRequest("r", messages=CHAT)).input_ids
