"""A multi-turn agent: a ReAct loop where the model picks Python tools between generations.

Each step the model writes a thought, then `select`s a tool and writes its
argument under a regex (so the call always parses); the program runs the tool
and appends the observation. `finish` ends the question. The conversation
keeps every turn, so the second question starts from the cached history.
"""

from __future__ import annotations

import ast
import operator

import radixlm as rl

FACTS = {
    "eiffel tower height": "330 metres",
    "paris population": "2.1 million people",
    "speed of light": "299792 km per second",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Arithmetic on numbers (+ - * / and parentheses), nothing else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        return f"{value(ast.parse(expression, mode='eval').body):g}"
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def lookup(topic: str) -> str:
    return FACTS.get(topic, "unknown")


TOOLS = {"calculator": calculator, "lookup": lookup}
ARGUMENT = {  # what each tool's argument may look like
    "calculator": r"[0-9][0-9+\-*/(). ]{0,23}",
    "lookup": "(" + "|".join(FACTS) + ")",
    "finish": r"[A-Za-z0-9 ,.'%-]{1,60}",
}
QUESTIONS = ["How tall is the Eiffel Tower?", "What is that height times 2?"]
SYSTEM = f"""Solve the task with tools, one action per line:
calculator[arithmetic], lookup[one of: {', '.join(FACTS)}], finish[the final answer].
Example:
Task: How many people live in two cities the size of Paris?
Thought: I need the population of Paris.
Action: lookup[paris population]
Observation: 2.1 million people
Thought: Two such cities have twice that.
Action: calculator[2.1 * 2]
Observation: 4.2
Thought: I know the answer.
Action: finish[4.2 million people]"""


@rl.function
def agent(s, questions, max_steps=3):
    s += rl.system(SYSTEM)
    trace = []
    for question in questions:
        s += rl.user(f"Task: {question}")
        s += rl.assistant_begin()
        for _ in range(max_steps):
            s += "Thought: " + rl.gen("thought", max_tokens=24, regex=r"[A-Z][^\n]{4,100}") + "\n"
            s += "Action: " + rl.select("action", ["lookup", "calculator", "finish"])
            action = s["action"]
            s += "[" + rl.gen("argument", regex=ARGUMENT[action]) + "]\n"
            step = {"question": question, "action": action, "argument": s["argument"]}
            if action == "finish":
                trace.append(step)
                break
            step["observation"] = TOOLS[action](s["argument"])
            trace.append(step)
            s += f"Observation: {step['observation']}\n"
        s += rl.assistant_end()
    s.set_var("trace", trace)


def main(backend: rl.Backend) -> dict:
    state = agent.run(questions=QUESTIONS, backend=backend, temperature=0)
    for step in state["trace"]:
        print(f"[{step['question']}] {step['action']}[{step['argument']}] -> {step.get('observation', '(final)')}")
    thoughts = [m for m in state.messages() if m["role"] == "assistant"]
    return {"trace": state["trace"], "turns": len(thoughts), "cached_tokens": state.get_meta_info("thought")["cached_tokens"]}


if __name__ == "__main__":
    from _backend import backend_from_args

    main(backend_from_args(__doc__.splitlines()[0]))
