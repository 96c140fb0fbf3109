"""The README's Python example, pasted into a file and run as a plain script: no
`if __name__ == "__main__":` guard, an Engine made at top level (its processes are spawned,
and a spawned child would re-run the script; runtime/launch.py keeps them from it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_engine_example() -> str:
    """The indented block of README.md that starts with `import radixlm`, as code."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    start = lines.index("    import radixlm")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("    "))
    return textwrap.dedent("\n".join(lines[start:end]))


def test_readme_example_runs_as_a_plain_script(tmp_path):
    code = readme_engine_example()
    assert "Engine()" in code and "__main__" not in code
    script = tmp_path / "example.py"
    script.write_text(code + '\nprint("DONE", out["meta_info"]["completion_tokens"])\n')
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^DONE [1-8]$", done.stdout, re.M), done.stdout[-2000:]  # the last call's tokens (max 8)
    assert "Paris" in done.stdout  # `print(out["text"], ...)` of "The capital of France is"
