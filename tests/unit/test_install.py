"""What `pip install` leaves behind: one import name, `radixlm`, and no top-level `runtime` or
`kernels` (the folders at the repository's top are mapped into `radixlm` by pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import importlib.util, json, sys
import radixlm
import radixlm.runtime.engine, radixlm.kernels.common, radixlm.lang.api
print(json.dumps({
    "radixlm": radixlm.__file__,
    "engine": radixlm.Engine.__module__, "local": radixlm.LocalEngine.__module__, "gen": radixlm.gen.__module__,
    "runtime": importlib.util.find_spec("runtime") is not None,
    "frontend_lang": importlib.util.find_spec("frontend_lang") is not None,
    "kernels": getattr(importlib.util.find_spec("kernels"), "origin", None),
}))
"""


def test_an_installed_copy_has_one_import_name(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), ROOT], check=True, capture_output=True, timeout=300)
    top = sorted(p.name for p in target.iterdir() if p.name != "bin")
    assert top == ["radixlm", "radixlm-0.1.0.dist-info"], top
    assert sorted(p.name for p in (target / "radixlm").iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "kernels", "lang", "runtime"]
    # the web page's static files travel with the package (package-data)
    static = target / "radixlm" / "runtime" / "server" / "static"
    assert sorted(p.name for p in static.iterdir()) == ["app.js", "chat.js", "dashboard.js", "index.html", "style.css"]
    # and its libraries' browser builds, those npm installed here (webui.VENDOR; nothing else of node_modules)
    from radixlm.runtime.server.webui import NODE_MODULES, VENDOR

    vendor = target / "radixlm" / "runtime" / "server" / "vendor" / "node_modules"
    here = sorted(path for path in VENDOR.values() if os.path.isfile(os.path.join(NODE_MODULES, path)))
    installed = sorted(str(p.relative_to(vendor)) for p in vendor.rglob("*") if p.is_file()) if vendor.exists() else []
    assert installed == here, (installed, here)
    # and the native kernels' C++ sources, built on the machine that runs them
    csrc = sorted(p.name for p in (target / "radixlm" / "kernels" / "cpu" / "csrc").iterdir())
    assert csrc == sorted(p.name for p in (Path(ROOT) / "kernels" / "cpu" / "csrc").iterdir()), csrc
    # run from elsewhere, so neither the repository nor its editable install can answer for it
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["radixlm"].startswith(str(target))
    assert (found["engine"], found["local"], found["gen"]) == (
        "radixlm.runtime.engine", "radixlm.runtime.local_engine", "radixlm.lang.api")
    assert not found["runtime"] and not found["frontend_lang"]
    # `kernels` is Hugging Face's hub-kernels package where that is installed; never ours
    assert found["kernels"] is None or not found["kernels"].startswith((str(target), ROOT))
