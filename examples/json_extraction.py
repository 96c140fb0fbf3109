"""Structured extraction: a JSON schema for a record, a regex for a date, in one program."""

from __future__ import annotations

import json

import radixlm as rl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
TEXTS = [
    "Maria Lopez, 34, moved to Valencia on 2021-05-14.",
    "On 2019-11-02 the 58-year-old Tom Baker opened a shop in Leeds.",
]


@rl.function
def extract(s, text):
    s += rl.system("You extract facts from text.")
    s += rl.user(f"Text: {text}\nGive the person's name, age and city as JSON.")
    s += rl.assistant(rl.gen("record", max_tokens=64, json_schema=SCHEMA))
    s += rl.user("And the date mentioned, as YYYY-MM-DD?")
    s += rl.assistant(rl.gen("date", regex=DATE))


def main(backend: rl.Backend) -> list[dict]:
    out = []
    for state in extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0):
        record = json.loads(state["record"])
        out.append({"record": record, "date": state["date"]})
        print(record, state["date"])
    return out


if __name__ == "__main__":
    from _backend import backend_from_args

    main(backend_from_args(__doc__.splitlines()[0]))
