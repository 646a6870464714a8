"""The web console at /app: static files shipped inside the package (nothing from a CDN: it works air-gapped).

The page and its assets hold no data, so they are served without a key; every figure the page shows comes from
the API routes, which require the key the page asks for (sent as `Authorization: Bearer`, as the client does).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from scalarlm.protocol.errors import NotFound

router = APIRouter(tags=["console"], include_in_schema=False)
ASSETS = Path(str(resources.files("scalarlm.server") / "console"))
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}
# The page may load only its own files and talk only to this server.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@router.get("/app")
def index_redirect() -> RedirectResponse:
    return RedirectResponse("/app/")


@router.get("/app/")
def index() -> FileResponse:
    """The console's single page."""
    return FileResponse(ASSETS / "index.html", media_type="text/html", headers=_HEADERS)


@router.get("/app/static/{name}")
def asset(name: str) -> FileResponse:
    """One of the console's own files (a flat folder: no path beyond it is reachable)."""
    path = ASSETS / name
    if "/" in name or name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        raise NotFound(f"no console file {name!r}")
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=_HEADERS)
