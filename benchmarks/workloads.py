"""The SGLang paper's workloads, generated deterministically (fixed seeds, no downloads).

Each program workload is a `radixlm.lang` program plus one argument dict per
run of it; systems without a DSL replay the requests the program made (see
`run_all.py`). The no-sharing workload is raw requests (token ids with a
ShareGPT-like length distribution): in real life it is not a program.

Every `gen` here has a fixed length (`ignore_eos`), so a workload does the same
work on every run and every system; the few-shot, HellaSwag-like and ReAct
prompts share long prefixes, the chat sessions share their own growing
histories, and tree-of-thought branches share their trunk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import radixlm as rl
from json_decode import CITIES, PEOPLE, SCHEMA


@dataclass
class Workload:
    name: str
    description: str
    program: rl.Function | None = None  # None: a raw workload (`requests`)
    args: list[dict[str, Any]] = field(default_factory=list)  # one per program run
    requests: list[tuple[list[int], int]] = field(default_factory=list)  # raw: (prompt ids, output length)
    concurrency: int = 0  # raw: clients in a closed loop
    only: tuple[str, ...] = ()  # systems that run it besides the defaults (e.g. "radixlm no-jump-forward")

    @property
    def size(self) -> int:
        return len(self.args) if self.program is not None else len(self.requests)


# ---- HellaSwag-like: a long shared few-shot context, then four endings to choose from -------------

_PEOPLE_NOUNS = ["A man", "A woman", "A boy", "A girl", "A chef", "A gardener", "A mechanic", "A teacher",
                 "An athlete", "A musician"]
_SCENES = [
    ("is standing in a small kitchen", ["chops onions on a wooden board", "pours oil into a hot pan",
                                        "stirs the sauce with a spoon", "tastes the soup and adds salt"]),
    ("is kneeling in a garden", ["digs a hole with a trowel", "plants a tomato seedling",
                                 "waters the flower bed", "pulls weeds from the soil"]),
    ("is working under a car", ["loosens a bolt with a wrench", "drains the old oil into a pan",
                                "replaces the worn brake pads", "checks the tire pressure"]),
    ("is standing at a whiteboard", ["writes an equation in blue marker", "erases the old notes",
                                     "points at a diagram", "asks the class a question"]),
    ("is stretching on a running track", ["ties the laces of the shoes", "jogs a slow warm-up lap",
                                          "sprints down the straight", "checks the time on a watch"]),
    ("is sitting at a piano", ["plays a slow scale", "turns the page of the score",
                               "adjusts the height of the bench", "presses the sustain pedal"]),
    ("is standing on a ladder", ["paints the ceiling white", "changes a light bulb",
                                 "cleans the top of the window", "hangs a picture frame"]),
    ("is at the edge of a pool", ["dives into the water", "adjusts the swimming goggles",
                                  "swims a length of freestyle", "climbs out using the steps"]),
]


def _hellaswag_item(rng: random.Random) -> tuple[str, list[str], int]:
    scene, actions = rng.choice(_SCENES)
    subject = rng.choice(_PEOPLE_NOUNS)
    first, right = rng.sample(actions, 2)
    wrong = [rng.choice(other) for _, other in rng.sample([s for s in _SCENES if s[0] != scene], 3)]
    endings = [right] + wrong
    rng.shuffle(endings)
    return f"{subject} {scene}. The person {first}. Then the person", [f" {e}." for e in endings], endings.index(right)


def hellaswag(n: int, shots: int = 8, seed: int = 7) -> Workload:
    rng = random.Random(seed)
    head = "Choose the most likely continuation of each scene.\n\n"
    for _ in range(shots):
        context, endings, answer = _hellaswag_item(rng)
        head += f"Scene: {context}{endings[answer]}\n\n"
    items = [_hellaswag_item(rng) for _ in range(n)]
    return Workload("hellaswag", f"{shots}-shot scenes shared by all, {n} questions, select among 4 endings",
                    hellaswag_program, [{"shots": head, "context": c, "endings": e} for c, e, _ in items])


@rl.function
def hellaswag_program(s, shots, context, endings):
    s += shots + "Scene: " + context
    s += rl.select("ending", endings)


# ---- multi-turn chat: each session's history grows; short and long answers -----------------------

_TOPICS = ["tidal energy", "sourdough bread", "the history of chess", "black holes", "learning Spanish",
           "composting at home", "electric bikes", "medieval castles", "jazz improvisation", "volcanoes",
           "budget travel", "houseplants", "marathon training", "board game design", "solar panels",
           "ancient Rome"]
_ASKS = ["Explain the basics of {t} to me.", "What are common mistakes people make with {t}?",
         "Give me three surprising facts about {t}.", "How would you start a weekend project on {t}?",
         "What should a beginner read about {t}?", "Compare two opposing views on {t}."]


@rl.function
def chat_program(s, messages, answer_tokens):
    for i, message in enumerate(messages):
        s += rl.user(message)
        s += rl.assistant(rl.gen(f"answer{i}", max_tokens=answer_tokens, ignore_eos=True, temperature=0))


def chat(sessions: int, turns: int = 4, short: int = 16, long: int = 96, seed: int = 3) -> Workload:
    rng = random.Random(seed)
    args = []
    for i in range(sessions):
        topic = _TOPICS[i % len(_TOPICS)]
        messages = [f"(session {i}) " + rng.choice(_ASKS).format(t=topic)]
        messages += [rng.choice(_ASKS).format(t=topic) + " Build on your last answer." for _ in range(turns - 1)]
        args.append({"messages": messages, "answer_tokens": short if i % 2 == 0 else long})
    return Workload("chat", f"{sessions} sessions x {turns} turns, answers of {short} or {long} tokens",
                    chat_program, args)


# ---- JSON decoding with a schema ------------------------------------------------------------------

@rl.function
def json_program(s, bio):
    s += rl.user(f"Extract name, age, city, is_student and hobbies as JSON from: {bio}")
    s += rl.assistant(rl.gen("json", max_tokens=128, json_schema=SCHEMA, temperature=0))


def json_extraction(n: int) -> Workload:
    bios = [f"{PEOPLE[i % len(PEOPLE)]} is {20 + i % 30} years old, lives in {CITIES[i % len(CITIES)]}, "
            f"{'studies' if i % 2 else 'works'} and likes chess, running and cooking." for i in range(n)]
    return Workload("json", f"{n} bios -> a 5-field JSON schema (jump-forward on; off as its own system)",
                    json_program, [{"bio": b} for b in bios], only=("radixlm no-jump-forward",))


# ---- tree of thought: fork into branches, judge each, expand the best ----------------------------

@rl.function
def tree_program(s, question, width, depth, step_tokens):
    s += rl.user(question + " Reason in short steps.")
    s += rl.assistant_begin()
    for level in range(depth):
        forks = s.fork(width)
        for i, branch in enumerate(forks):
            branch += f"Step {level + 1}: " + rl.gen("step", max_tokens=step_tokens, ignore_eos=True,
                                                     temperature=0.8, seed=100 * level + i)
            branch += "\nIs this step correct and useful? " + rl.select("judge", ["yes", "no"])
        forks.join()
        scores = [b.get_meta_info("judge")["normalized_scores"] for b in forks]
        best = max(range(width), key=lambda i: scores[i][0] - scores[i][1])
        s += f"Step {level + 1}: {forks[best]['step']}\n"
    s += "Answer: " + rl.gen("answer", max_tokens=step_tokens, ignore_eos=True, temperature=0)
    s += rl.assistant_end()


def tree_of_thought(n: int, width: int = 3, depth: int = 2, step_tokens: int = 24, seed: int = 5) -> Workload:
    rng = random.Random(seed)
    questions = []
    for _ in range(n):
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(10, 99)
        questions.append(f"A shop has {a} shelves with {b} boxes each and sells {c} more boxes online. "
                         "How many boxes does it sell in all?")
    return Workload("tree-of-thought", f"{n} questions, {depth} levels of {width} forked branches + a judge "
                    "select each", tree_program,
                    [{"question": q, "width": width, "depth": depth, "step_tokens": step_tokens} for q in questions])


# ---- ReAct agent: a replayed trace, the tool outputs fixed ----------------------------------------

_REACT_HEAD = """Answer the question by interleaving Thought, Action and Observation steps.
Actions: Search[entity] looks an entity up, Lookup[keyword] finds a keyword in the last page, Finish[answer] ends.

Question: Which city is the capital of the country where the Eiffel Tower stands?
Thought: I need to find out where the Eiffel Tower is.
Action: Search[Eiffel Tower]
Observation: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It was built for the 1889 World's Fair.
Thought: The tower is in France, so I need the capital of France.
Action: Search[France]
Observation: France is a country in Western Europe. Its capital and largest city is Paris.
Thought: The capital of France is Paris.
Action: Finish[Paris]

"""
_ENTITIES = ["the Danube", "Mount Kilimanjaro", "the Great Barrier Reef", "the Atacama Desert", "Lake Baikal",
             "the Amazon rainforest", "the Sahara", "Mont Blanc", "the Gobi Desert", "the Mekong",
             "Table Mountain", "the Dead Sea", "the Rhine", "Mount Fuji", "the Andes", "Victoria Falls"]


@rl.function
def react_program(s, question, observations, thought_tokens, action_tokens):
    s += _REACT_HEAD + "Question: " + question + "\n"
    for i, observation in enumerate(observations):
        s += "Thought:" + rl.gen(f"thought{i}", max_tokens=thought_tokens, ignore_eos=True, temperature=0)
        s += "\nAction:" + rl.gen(f"action{i}", max_tokens=action_tokens, ignore_eos=True, temperature=0)
        s += "\nObservation: " + observation + "\n"


def react(agents: int, steps: int = 4, thought_tokens: int = 32, action_tokens: int = 12) -> Workload:
    args = []
    for i in range(agents):
        entity = _ENTITIES[i % len(_ENTITIES)]
        observations = [f"{entity[0].upper() + entity[1:]} is a landmark visited by about {(i + 1) * 37 + k} thousand "
                        f"people each year; page {k + 1} of its article lists its location, size and history."
                        for k in range(steps)]
        args.append({"question": f"In which country is {entity}, and what is that country's capital?",
                     "observations": observations, "thought_tokens": thought_tokens,
                     "action_tokens": action_tokens})
    return Workload("react", f"{agents} agents x {steps} steps (thought {thought_tokens} + action {action_tokens} "
                    "tokens, fixed tool outputs), one shared instruction + example", react_program, args)


# ---- no sharing: random prompts and outputs, ShareGPT-like lengths --------------------------------

def no_sharing(n: int, concurrency: int = 32, prompt_median: int = 160, output_median: int = 96,
               max_prompt: int = 1024, max_output: int = 320, seed: int = 11, vocab: int = 48000) -> Workload:
    """Log-normal prompt and output lengths (the shape of ShareGPT's), random token ids."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(prompt_median), 0.8, n), 8, max_prompt).astype(int)
    outputs = np.clip(rng.lognormal(np.log(output_median), 0.7, n), 4, max_output).astype(int)
    requests = [(rng.integers(100, vocab, int(p)).tolist(), int(o)) for p, o in zip(prompts, outputs)]
    return Workload("no-sharing", f"{n} ShareGPT-like random requests (median prompt {prompt_median}, output "
                    f"{output_median}), {concurrency} clients", requests=requests, concurrency=concurrency)


# ---- few-shot multiple choice (MMLU-like): a 5-shot prefix every question shares -----------------

LETTERS = ["A", "B", "C", "D"]


def _mmlu_question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = a + b
    options = {right}
    while len(options) < 4:
        options.add(right + rng.choice([-20, -10, -2, -1, 1, 2, 10, 20]))
    options = sorted(options, key=lambda _: rng.random())
    text = f"Question: What is {a} + {b}?\n" + "".join(f"{letter}. {o}\n" for letter, o in zip(LETTERS, options))
    return text + "Answer:", options.index(right)


@rl.function
def mmlu_program(s, shots, text):
    s += shots + text
    s += rl.select("answer", [f" {letter}" for letter in LETTERS])


def mmlu(n: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    shots = "The following are multiple choice questions about arithmetic.\n\n"
    for _ in range(5):
        text, answer = _mmlu_question(rng)
        shots += f"{text} {LETTERS[answer]}\n\n"
    items = [_mmlu_question(rng) for _ in range(n)]
    return Workload("mmlu", f"5-shot arithmetic prefix shared by all, {n} questions, select among A-D",
                    mmlu_program, [{"shots": shots, "text": text} for text, _ in items])


def all_workloads(quick: bool) -> list[Workload]:
    if quick:
        return [mmlu(3), hellaswag(3, shots=3), chat(2, turns=2, short=4, long=8), json_extraction(2),
                tree_of_thought(1, width=2, depth=1, step_tokens=6), react(2, steps=2, thought_tokens=6,
                                                                          action_tokens=4),
                no_sharing(6, concurrency=4, prompt_median=32, output_median=6, max_prompt=64, max_output=12)]
    return [mmlu(64), hellaswag(64), chat(16), json_extraction(32), tree_of_thought(8), react(16), no_sharing(96)]
