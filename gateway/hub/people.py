"""People who sign in to the status page with OpenID Connect (issue 34, point 3): the sign-in
routes (``/auth/login``, ``/auth/callback``, ``/auth/me``, ``/auth/logout``), the page session
(an HttpOnly, SameSite=Lax cookie, Secure under TLS; a CSRF token on every state-changing
request), a person's role, and what a member may do on the admin API (their own keys and usage).

The session's token lives in the browser's cookie only; the store keeps its hash. The CSRF
token is derived from the session token (an HMAC), so the page reads it from ``/auth/me`` and
sends it back as ``X-CSRF-Token``; a page of another site can neither read nor forge it."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from gateway.hub.oidc import LOGIN_TTL, Login, Oidc, OidcError, Person
from gateway.hub.routekit import HTTPError, Request, header
from gateway.hub.store import Store, token_hash
from gateway.hub.store import people_ops as ops
from gateway.hub.store.credentials import key_id_of
from gateway.hub.store.people_ops import PageSession

log = logging.getLogger("gateway.hub.people")

SESSION_COOKIE = "alp_session"
LOGIN_COOKIE = "alp_login"
CSRF_HEADER = b"x-csrf-token"
SESSION_TOKEN = re.compile(r"[A-Za-z0-9_-]{20,100}")
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")
NO_STORE = [(b"cache-control", b"no-store")]
SAFE_METHODS = ("GET", "HEAD")
ADMIN, MEMBER = "admin", "member"
PERSON = "person"  # the request scope's key of the signed-in person's PageSession


def cookies(req: Request) -> dict[str, str]:
    """The request's cookies (the first of each name)."""
    found: dict[str, str] = {}
    for name, value in req.scope["headers"]:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, sep, val = part.strip().partition("=")
            if sep and key not in found:
                found[key] = val
    return found


def csrf_of(session_token: str) -> str:
    """The CSRF token of a page session: derived from its token, never stored."""
    return hmac.new(session_token.encode(), b"alp-hub csrf", hashlib.sha256).hexdigest()[:40]


def person(req: Request) -> PageSession | None:
    """The signed-in person the request came from (None: the admin credential, or no one)."""
    found = req.scope.get(PERSON)
    return found if isinstance(found, PageSession) else None


class People:
    """Sign-in and page sessions of one hub with ``--oidc-issuer`` (``oidc`` None: no sign-in,
    the admin credential alone)."""

    def __init__(self, store: Store, settings: Any, oidc: Oidc | None) -> None:
        self.store = store
        self.settings = settings
        self.oidc = oidc

    @property
    def enabled(self) -> bool:
        return self.oidc is not None

    # -- cookies -----------------------------------------------------------------------------

    def _cookie(self, req: Request, name: str, value: str, max_age: int, path: str = "/") -> bytes:
        secure = "; Secure" if req.scope.get("scheme") == "https" else ""
        return (
            f"{name}={value}; Path={path}; Max-Age={max_age}; HttpOnly; SameSite=Lax{secure}"
        ).encode()

    def _redirect_uri(self, req: Request) -> str:
        base = self.settings.oidc_redirect_url
        if base is None:
            host = (header(req.scope, b"host") or b"").decode("latin-1")
            if not _HOST.fullmatch(host):
                raise HTTPError(400, "the request's Host header is not a host name", "bad_host")
            base = f"{req.scope.get('scheme') or 'http'}://{host}"
        return base.rstrip("/") + "/auth/callback"

    # -- the routes ----------------------------------------------------------------------------

    async def login(self, req: Request) -> None:
        """``GET /auth/login``: to the issuer, a fresh state, nonce and PKCE verifier kept in a
        short-lived cookie of the callback's path."""
        oidc = self._need()
        try:
            url, started = await oidc.start(self._redirect_uri(req))
        except OidcError as exc:
            log.warning("sign-in cannot start: %s", exc)
            raise HTTPError(502, str(exc), "oidc_unavailable") from None
        cookie = self._cookie(req, LOGIN_COOKIE, started.cookie(), LOGIN_TTL, "/auth/")
        await req.resp.whole(
            302, b"", [(b"location", url.encode()), (b"set-cookie", cookie), *NO_STORE]
        )

    async def callback(self, req: Request) -> None:
        """``GET /auth/callback?code&state``: the state checked against the cookie's, the code
        exchanged, the ID token verified; a page session, and back to the page."""
        oidc = self._need()
        query = parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
        error = (query.get("error") or [None])[0]
        if error is not None:
            raise HTTPError(401, "the identity provider refused the sign-in", "login_refused")
        code = (query.get("code") or [""])[0]
        state = (query.get("state") or [""])[0]
        started = Login.from_cookie(cookies(req).get(LOGIN_COOKIE, ""))
        if started is None:
            raise HTTPError(
                400, "no sign-in was started in this browser (or it took too long)", "login_refused"
            )
        if not state or not hmac.compare_digest(state.encode(), started.state.encode()):
            raise HTTPError(400, "the sign-in's state does not match: refused", "login_refused")
        if not code or len(code) > 2048:
            raise HTTPError(400, "the sign-in came back without a code", "login_refused")
        try:
            found = await oidc.finish(code, started, self._redirect_uri(req))
        except OidcError as exc:
            log.warning("a sign-in was refused: %s", exc)
            raise HTTPError(401, f"sign-in refused: {exc}", "login_refused") from None
        role = self.role_of(found)
        token = secrets.token_urlsafe(32)
        now = time.time()
        lifetime = self.settings.oidc_session_lifetime
        await self.store.people(
            ops.start_session(
                token_hash(token), found.sub, found.email, found.name, role, now, now + lifetime
            )
        )
        log.info("%s signed in to the status page as %s", found.email or found.sub, role)
        cleared = self._cookie(req, LOGIN_COOKIE, "", 0, "/auth/")
        session = self._cookie(req, SESSION_COOKIE, token, int(lifetime))
        await req.resp.whole(
            303,
            b"",
            [(b"location", b"/"), (b"set-cookie", cleared), (b"set-cookie", session), *NO_STORE],
        )

    async def me(self, req: Request) -> None:
        """``GET /auth/me``: whether sign-in is on, and who is signed in (with the CSRF token
        the page sends back on every change)."""
        answer: dict[str, Any] = {"oidc": self.enabled, "signedIn": False}
        token = self._session_token(req)
        found = None if token is None else await self._session(token)
        if token is not None and found is not None:
            answer.update(
                signedIn=True,
                sub=found.sub,
                email=found.email,
                name=found.name,
                role=found.role,
                csrf=csrf_of(token),
                projects=await self.projects_of(found.sub),
            )
        await req.resp.json(200, answer, NO_STORE)

    async def logout(self, req: Request) -> None:
        """``POST /auth/logout`` (the CSRF token required): the session ended, its cookie
        cleared."""
        token = self._session_token(req)
        if token is not None:
            self._check_csrf(req, token)
            await self.store.people(ops.end_session(token_hash(token)))
        cleared = self._cookie(req, SESSION_COOKIE, "", 0)
        await req.resp.json(200, {"signedOut": True}, [(b"set-cookie", cleared), *NO_STORE])

    # -- the admin API's guard -----------------------------------------------------------------

    def has_session(self, req: Request) -> bool:
        """Whether the request carries a page session cookie to check (a hub with sign-in)."""
        return self.enabled and self._session_token(req) is not None

    async def authorize(
        self, req: Request, handler: Callable[[Request], Awaitable[None]], member_ok: bool
    ) -> None:
        """A request to ``/api/hub/`` with a session cookie: the session must be live, a
        state-changing request must carry its CSRF token, and a member may use only the
        routes ``member_ok`` says (their own keys and usage). HTTPError 401/403 else."""
        token = self._session_token(req)
        found = None if token is None else await self._session(token)
        if token is None or found is None:
            raise HTTPError(401, "sign in again: the page session has ended", "signed_out")
        if req.scope["method"] not in SAFE_METHODS:
            self._check_csrf(req, token)
        if found.role != ADMIN and not member_ok:
            raise HTTPError(403, "this needs an admin: members see their own keys and usage")
        req.scope[PERSON] = found

    def role_of(self, found: Person) -> str:
        group = self.settings.oidc_admin_group
        return ADMIN if group is not None and group in found.groups else MEMBER

    # -- helpers -------------------------------------------------------------------------------

    def _need(self) -> Oidc:
        if self.oidc is None:
            raise HTTPError(404, "sign-in is not set up on this hub (--oidc-issuer)", "unknown_url")
        return self.oidc

    def _session_token(self, req: Request) -> str | None:
        value = cookies(req).get(SESSION_COOKIE)
        return value if value is not None and SESSION_TOKEN.fullmatch(value) else None

    async def _session(self, token: str) -> PageSession | None:
        return await self.store.people(ops.page_session(token_hash(token), time.time()))

    def _check_csrf(self, req: Request, token: str) -> None:
        sent = header(req.scope, CSRF_HEADER) or b""
        if not hmac.compare_digest(sent, csrf_of(token).encode()):
            raise HTTPError(403, "the CSRF token is missing or wrong: reload the page", "csrf")

    # -- what members may do -------------------------------------------------------------------

    async def projects_of(self, sub: str) -> list[str]:
        """The projects ``sub`` may make keys for: the admin's choice for them, else
        ``--oidc-member-projects``."""
        found = await self.store.people(ops.projects_of(sub))
        return list(self.settings.oidc_member_projects) if found is None else found

    async def set_projects(self, sub: str, projects: list[str] | None) -> bool:
        return await self.store.people(ops.set_projects(sub, projects))

    async def own(self, key: str, name: str, who: PageSession) -> None:
        """The new API key ``key`` (named ``name``) carries ``who``'s identity."""
        digest = token_hash(key)
        await self.store.people(
            ops.add_key_owner(digest, key_id_of(digest), name, who.sub, who.email)
        )

    async def owner_of(self, name: str) -> str | None:
        """The ``sub`` of the person owning the active key ``name`` (None: none, or no one's)."""
        return await self.store.people(ops.owner_of_active(name))

    async def owners(self) -> dict[tuple[str, str], tuple[str, str | None]]:
        """Every owned key's (name, created at) -> (sub, email)."""
        return await self.store.people(ops.key_owners())

    async def listing(self) -> list[dict[str, Any]]:
        return await self.store.people(ops.people())

    async def usage(self, since: float, sub: str | None = None) -> list[dict[str, Any]]:
        """Hourly usage per person and model since ``since`` (of ``sub`` alone, if given), as
        ``/api/hub/usage?by=person`` answers it (``person`` None: keys no person owns)."""
        rows = await self.store.people(ops.person_usage(since, sub))
        return [
            {
                "hour": r.hour,
                "person": r.sub,
                "email": r.email,
                "model": r.model,
                "turns": r.turns,
                "promptTokens": r.prompt_tokens,
                "completionTokens": r.completion_tokens,
                "errors": r.errors,
                "estimated": r.estimated,
            }
            for r in rows
        ]
