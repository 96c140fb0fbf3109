"""The web page at `/`: a chat playground and a live view of the cache and the batch.

The page's own files are `static/` (index.html, app.js, style.css), served from the package by
the app; the page talks to the same API as any client (`/v1/models`, `/v1/chat/completions`,
`/debug/dashboard`). `radixlm serve --no-webui` leaves it out.

Its libraries (markdown, sanitising, code highlighting, charts) come from the npm registry:
`vendor/package.json` pins them and scripts/setup.sh runs `npm ci` there. Only the browser
builds in `VENDOR` are served, from the installed package, and only those present: without them
the page shows replies as plain text and no charts. Nothing is fetched at run time.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

HERE = os.path.dirname(os.path.abspath(__file__))
WEBUI_DIR = os.path.join(HERE, "static")
NODE_MODULES = os.path.join(HERE, "vendor", "node_modules")
WEBUI_PATHS = ("/", "/webui/*")  # open without the API key: the page asks for it
# served name -> its file under vendor/node_modules (pyproject.toml's package-data lists the same)
VENDOR = {
    "marked.js": "marked/lib/marked.umd.js",
    "purify.js": "dompurify/dist/purify.min.js",
    "highlight.js": "@highlightjs/cdn-assets/highlight.min.js",
    "highlight.css": "@highlightjs/cdn-assets/styles/github.min.css",
    "uPlot.js": "uplot/dist/uPlot.iife.min.js",
    "uPlot.css": "uplot/dist/uPlot.min.css",
}


def installed_vendor_files() -> list[str]:
    """The names in VENDOR whose file is installed."""
    return [name for name, path in VENDOR.items() if os.path.isfile(os.path.join(NODE_MODULES, path))]


def _index_html(vendor: list[str]) -> str:
    """index.html with a tag for each installed library where it says <!-- vendor -->."""
    tags = [f'<link rel="stylesheet" href="/webui/vendor/{n}">' if n.endswith(".css")
            else f'<script src="/webui/vendor/{n}"></script>' for n in vendor]
    with open(os.path.join(WEBUI_DIR, "index.html")) as f:
        return f.read().replace("<!-- vendor -->", "\n".join(tags))


def add_webui(app: FastAPI) -> None:
    vendor = installed_vendor_files()
    page = _index_html(vendor)

    @app.get("/webui/vendor/{name}", include_in_schema=False)
    async def vendor_file(name: str) -> FileResponse:
        if name not in vendor:
            raise HTTPException(404)
        return FileResponse(os.path.join(NODE_MODULES, VENDOR[name]), headers={"Cache-Control": "max-age=3600"})

    app.mount("/webui", StaticFiles(directory=WEBUI_DIR), name="webui")

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})
