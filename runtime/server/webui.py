"""The web page at `/`: a chat playground and a live view of the cache and the batch.

Static files only (`static/`: index.html, app.js, style.css; no library, no build step), served
from the package by the app; the page talks to the same API as any client (`/v1/models`,
`/v1/chat/completions`, `/debug/dashboard`). `radixlm serve --no-webui` leaves it out.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEBUI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
WEBUI_PATHS = ("/", "/webui/*")  # open without the API key: the page asks for it


def add_webui(app: FastAPI) -> None:
    app.mount("/webui", StaticFiles(directory=WEBUI_DIR), name="webui")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(os.path.join(WEBUI_DIR, "index.html"), headers={"Cache-Control": "no-cache"})
