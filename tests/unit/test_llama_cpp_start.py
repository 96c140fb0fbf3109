"""run_all starts llama.cpp as its users get it: its defaults (repacked weights, its fast path), and
`--no-repack` only where those do not start, said beside every ratio (issue 47, item 18). A stand-in
`llama-server` (a Python script) that dies at start unless given `--no-repack`, or never dies."""

from __future__ import annotations

import os
import stat
import sys
import textwrap

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import run_all  # noqa: E402

STAND_IN = """\
    #!{python}
    import http.server, sys
    if {crashes} and "--no-repack" not in sys.argv:
        sys.exit("ggml_abort: the repacked path's assertion")
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _stand_in(folder, crashes: bool) -> str:
    path = os.path.join(folder, "llama-server")
    with open(path, "w") as f:
        f.write(textwrap.dedent(STAND_IN).format(python=sys.executable, crashes=crashes))
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize("crashes", [False, True])
def test_llama_cpp_starts_with_its_defaults_and_falls_back_only_when_they_fail(tmp_path, crashes):
    binary = _stand_in(tmp_path, crashes)
    with run_all.serving_llama_cpp(binary, "model.gguf", 2, 64, "--no-webui") as (url, which, command):
        assert httpx.get(url + "/health").status_code == 200
        assert ("--no-repack" in command) == crashes and "--no-webui" in command
        assert which == (run_all.LLAMA_NO_REPACK if crashes else run_all.LLAMA_DEFAULTS)
    header = run_all.offline_report([], [], which)[2]
    assert f"vs llama.cpp ({which})" in header


def test_a_llama_cpp_that_starts_neither_way_is_an_error_with_its_log(tmp_path):
    binary = os.path.join(tmp_path, "llama-server")
    with open(binary, "w") as f:
        f.write("#!/bin/sh\necho 'illegal instruction in its kernels'\nexit 3\n")
    os.chmod(binary, 0o755)
    with pytest.raises(RuntimeError, match="illegal instruction in its kernels"):
        with run_all.serving_llama_cpp(binary, "model.gguf", 2, 64):
            pass
