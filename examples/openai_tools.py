"""Tool calling over the OpenAI API: the model asks for functions, we run them and send back the results.

Run against a live server: `python examples/openai_tools.py [http://127.0.0.1:30000/v1]`.
The first turn forces a call (`tool_choice="required"`: the output is constrained to calls that
match the tools' schemas, which a model as small as SmolLM2-135M needs); later turns let the model
choose (`"auto"`) until it answers in text.
"""

from __future__ import annotations

import json
import sys

import openai

WEATHER = {"paris": (18, "cloudy"), "oslo": (-3, "snow"), "rome": (24, "sunny")}


def get_weather(city: str) -> dict:
    temperature, sky = WEATHER.get(city.strip().lower(), (None, "unknown city"))
    return {"city": city, "temperature_celsius": temperature, "sky": sky}


def add(a: int, b: int) -> dict:
    return {"sum": a + b}


FUNCTIONS = {"get_weather": get_weather, "add": add}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


def main(base_url: str = "http://127.0.0.1:30000/v1", question: str = "What is the weather in Paris?",
         max_turns: int = 3) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages: list[dict] = [{"role": "user", "content": question}]
    calls, usages = [], []
    print(f"user: {question}")
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice="required" if turn == 0 else "auto",
            max_tokens=96, temperature=0)
        usages.append(reply.usage)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"assistant: {message.content}")
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = FUNCTIONS[call.function.name](**arguments)
            print(f"assistant calls {call.function.name}({arguments}) -> {result}")
            calls.append({"name": call.function.name, "arguments": arguments, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return {"calls": calls, "answer": messages[-1].get("content"), "usages": usages}


if __name__ == "__main__":
    main(*sys.argv[1:])
