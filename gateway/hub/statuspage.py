"""The hub's status page: static files from the package (``gateway/hub/page/``), served
without a credential; everything they show comes from the admin JSON API (``/api/hub/``), which
the page calls with the admin credential the user typed in (kept in the tab's sessionStorage).

Nothing is fetched from elsewhere (a hub on a LAN without internet shows it whole), and the
content security policy says so to the browser: scripts, styles and requests from the hub only.
"""

from __future__ import annotations

from importlib import resources

from gateway.hub.routekit import HTTPError, Request

# file name -> content type; "/" is index.html
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-cache"),
]


def load_files() -> dict[str, tuple[bytes, bytes]]:
    """Every page file: name -> (content type, bytes), read from the package once."""
    folder = resources.files("gateway.hub").joinpath("page")
    return {
        name: (kind.encode(), folder.joinpath(name).read_bytes()) for name, kind in FILES.items()
    }


class StatusPage:
    """``GET /`` (index.html) and ``GET /page/{app.js,style.css}``."""

    def __init__(self) -> None:
        self.files = load_files()

    async def index(self, req: Request) -> None:
        await self._send(req, "index.html")

    async def asset(self, req: Request) -> None:
        name = req.params.get("name", "")
        if name == "index.html" or name not in self.files:
            raise HTTPError(404, f"Invalid URL (GET /page/{name})", "unknown_url")
        await self._send(req, name)

    async def _send(self, req: Request, name: str) -> None:
        kind, data = self.files[name]
        await req.resp.whole(200, data, [(b"content-type", kind), *SECURITY_HEADERS])
