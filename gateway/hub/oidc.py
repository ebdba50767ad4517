"""The hub as an OpenID Connect client (issue 34): the issuer's discovery document, the
authorization-code flow with PKCE (S256), the code exchanged at the token endpoint, and the ID
token verified (its signature by the issuer's JWKS, ``iss``, ``aud``, ``exp``, ``nonce``).

The signature is checked with ``rsa`` (pure Python: ``rsa.verify``, RSASSA-PKCS1-v1_5, which
re-encodes the expected block and compares it whole) against the issuer's JWKS, and the claims
with PyJWT (pure Python: ``jwt.decode`` once the signature holds); neither brings a compiled
crypto library into the one-file binary. RS256, RS384 and RS512 only: what OpenID Connect
requires issuers to offer (RS256) and what they sign ID tokens with by default. The HTTP calls
are httpx's, each bounded in time and size. Nothing here logs a secret: the client
secret, the code, the tokens and the verifier never reach a log line or an error message.

httpx, PyJWT and rsa are imported where they are first used, not with this module: every hub
imports it (``people``), and a hub that signs nobody in would carry them for nothing (with
the cryptography package PyJWT takes in when it is there: some 12 MB of a hub's memory and a
tenth of a second of its start)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from gateway.config import HubSettings

if TYPE_CHECKING:
    import httpx
    import rsa

log = logging.getLogger("gateway.hub.oidc")

TIMEOUT = 10.0  # s: each call to the issuer
MAX_ANSWER = 256 * 1024  # bytes: a discovery document, a JWKS, a token answer
DISCOVERY_TTL = 3600.0  # s: the discovery document and JWKS are read again after this
JWKS_REFETCH = 30.0  # s: an unknown key id reads the JWKS again at most this often
LEEWAY = 60  # s: clock skew allowed on exp, iat, nbf
LOGIN_TTL = 600  # s: a sign-in must come back from the issuer within this
# RSA signatures only (the hash each uses, as ``rsa.verify`` names it): "none" and HMAC (keyed
# with a secret the client shares) never
ALGORITHMS = {"RS256": "SHA-256", "RS384": "SHA-384", "RS512": "SHA-512"}
MAX_KEYS = 32  # keys of a JWKS looked at, at most


class OidcError(ValueError):
    """A sign-in that cannot go on (or a client that cannot be set up); the message is one
    line, safe to show and log."""


@dataclass(frozen=True, slots=True)
class Discovery:
    """What the hub reads of the issuer's ``/.well-known/openid-configuration``."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    scopes: tuple[str, ...]
    algorithms: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Login:
    """One sign-in on its way: what the browser carries to the issuer and back (``state``),
    what the ID token must carry (``nonce``), and the PKCE verifier of the code."""

    state: str
    nonce: str
    verifier: str

    def cookie(self) -> str:
        return f"{self.state}.{self.nonce}.{self.verifier}"

    @classmethod
    def from_cookie(cls, value: str) -> Login | None:
        parts = value.split(".")
        if len(parts) != 3 or not all(0 < len(p) <= 128 for p in parts):
            return None
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Person:
    """Who signed in, as the verified ID token says."""

    sub: str
    email: str | None
    name: str | None
    groups: tuple[str, ...]


def challenge(verifier: str) -> str:
    """PKCE's S256 code challenge of ``verifier`` (RFC 7636 §4.2)."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def client_secret(settings: HubSettings) -> str | None:
    """The client secret: ``--oidc-client-secret-file``'s first line, else the setting (the
    environment); None for a public client. OSError when the file cannot be read."""
    path = settings.oidc_client_secret_file
    if path is not None:
        text = path.read_text(encoding="utf-8").strip()
        if not text:
            raise OidcError(f"the OIDC client secret file {path} is empty")
        return text.splitlines()[0].strip()
    return settings.oidc_client_secret or None


class Oidc:
    """The hub's OpenID Connect client of one issuer (``settings.oidc_issuer``)."""

    def __init__(self, settings: HubSettings) -> None:
        if settings.oidc_issuer is None or settings.oidc_client_id is None:
            raise ValueError("an OIDC client needs --oidc-issuer and --oidc-client-id")
        self.settings = settings
        self.issuer = settings.oidc_issuer
        self.client_id = settings.oidc_client_id
        self._secret = client_secret(settings)
        self._discovery: tuple[Discovery, float] | None = None
        self._jwks: tuple[dict[str | None, rsa.PublicKey], float] | None = None

    # -- the issuer's documents -------------------------------------------------------------

    async def _get_json(self, url: str, what: str) -> dict[str, Any]:
        import httpx  # (the module's docstring: here, not with the module)

        try:
            async with (
                httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as client,
                client.stream("GET", url, headers={"accept": "application/json"}) as resp,
            ):
                body = await _read_bounded(resp, what)
        except httpx.HTTPError as exc:
            raise OidcError(
                f"the OIDC issuer's {what} could not be read: {type(exc).__name__}"
            ) from None
        return _json_object(body, what, resp.status_code)

    async def discovery(self) -> Discovery:
        """The issuer's discovery document (read again after ``DISCOVERY_TTL``)."""
        now = time.monotonic()
        if self._discovery is not None and self._discovery[1] > now:
            return self._discovery[0]
        doc = await self._get_json(
            self.issuer + "/.well-known/openid-configuration", "discovery document"
        )
        if doc.get("issuer") != self.issuer:
            raise OidcError(
                "the OIDC issuer's discovery document names another issuer than --oidc-issuer"
            )
        fields: dict[str, str] = {}
        for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            value = doc.get(name)
            if not isinstance(value, str) or not value.startswith(("https://", "http://")):
                raise OidcError(f"the OIDC issuer's discovery document has no {name}")
            fields[name] = value
        methods = doc.get("code_challenge_methods_supported")
        if isinstance(methods, list) and "S256" not in methods:
            raise OidcError("the OIDC issuer does not support PKCE with S256")
        scopes = doc.get("scopes_supported")
        algs = doc.get("id_token_signing_alg_values_supported")
        found = Discovery(
            issuer=self.issuer,
            scopes=tuple(s for s in scopes if isinstance(s, str))
            if isinstance(scopes, list)
            else (),
            algorithms=tuple(a for a in algs if a in ALGORITHMS)
            if isinstance(algs, list)
            else ("RS256",),  # the discovery spec's default
            **fields,
        )
        self._discovery = (found, now + DISCOVERY_TTL)
        return found

    async def _keys(
        self, disco: Discovery, *, fresh: bool = False
    ) -> dict[str | None, rsa.PublicKey]:
        now = time.monotonic()
        kept = self._jwks
        if kept is not None and not fresh and kept[1] > now:
            return kept[0]
        if kept is not None and fresh and kept[1] - DISCOVERY_TTL + JWKS_REFETCH > now:
            return kept[0]  # read moments ago: an unknown key id does not make it read again
        doc = await self._get_json(disco.jwks_uri, "JWKS")
        keys = _rsa_keys(doc)
        if not keys:
            raise OidcError("the OIDC issuer's JWKS holds no usable (RSA) key")
        self._jwks = (keys, now + DISCOVERY_TTL)
        return keys

    # -- the flow ----------------------------------------------------------------------------

    async def start(self, redirect_uri: str) -> tuple[str, Login]:
        """A new sign-in: the issuer's authorization URL to send the browser to, and what the
        browser's cookie keeps till it comes back."""
        disco = await self.discovery()
        login = Login(
            state=secrets.token_urlsafe(24),
            nonce=secrets.token_urlsafe(24),
            verifier=secrets.token_urlsafe(48),
        )
        scopes = ["openid", "email", "profile"]
        claim = self.settings.oidc_groups_claim
        if claim in disco.scopes and claim not in scopes:
            scopes.append(claim)  # e.g. "groups", where the issuer offers it as a scope
        query = urlencode(
            {
                "response_type": "code",
                "client_id": self.client_id,
                "redirect_uri": redirect_uri,
                "scope": " ".join(scopes),
                "state": login.state,
                "nonce": login.nonce,
                "code_challenge": challenge(login.verifier),
                "code_challenge_method": "S256",
            }
        )
        sep = "&" if "?" in disco.authorization_endpoint else "?"
        return f"{disco.authorization_endpoint}{sep}{query}", login

    async def finish(self, code: str, login: Login, redirect_uri: str) -> Person:
        """The code exchanged for tokens (with the PKCE verifier), the ID token verified
        (signature, ``iss``, ``aud``, ``exp``, ``nonce``): who signed in. OidcError else."""
        disco = await self.discovery()
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": login.verifier,
        }
        auth: tuple[str, str] | None = None
        if self._secret is not None:  # client_secret_basic (RFC 6749 §2.3.1)
            auth = (self.client_id, self._secret)
        else:
            form["client_id"] = self.client_id
        import httpx

        try:
            async with (
                httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as client,
                client.stream(
                    "POST",
                    disco.token_endpoint,
                    data=form,
                    auth=auth,
                    headers={"accept": "application/json"},
                ) as resp,
            ):
                body = await _read_bounded(resp, "token answer")
        except httpx.HTTPError as exc:
            raise OidcError(
                f"the OIDC issuer's token endpoint failed: {type(exc).__name__}"
            ) from None
        answer = _json_object(body, "token answer", resp.status_code)
        id_token = answer.get("id_token")
        if not isinstance(id_token, str):
            raise OidcError("the OIDC issuer's token answer has no ID token")
        claims = await self.verify(id_token, login.nonce, disco)
        return _person(claims, self.settings.oidc_groups_claim)

    async def verify(self, id_token: str, nonce: str, disco: Discovery) -> dict[str, Any]:
        """The claims of ``id_token`` once verified; OidcError saying what failed."""
        import jwt
        import rsa

        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise OidcError("the ID token is malformed") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS or alg not in disco.algorithms:
            raise OidcError("the ID token is signed with an algorithm the hub does not accept")
        kid = header.get("kid")
        key = _find_key(await self._keys(disco), kid)
        if key is None:  # the issuer rotated its keys: read them again (at most so often)
            key = _find_key(await self._keys(disco, fresh=True), kid)
        if key is None:
            raise OidcError("the ID token is signed with a key the issuer's JWKS does not hold")
        signed, _, signature = id_token.rpartition(".")
        try:
            method = rsa.verify(signed.encode("ascii"), _b64(signature), key)
        except (rsa.VerificationError, ValueError, UnicodeEncodeError):
            raise OidcError("the ID token's signature does not verify") from None
        if method != ALGORITHMS[alg]:  # signed with another hash than its header says
            raise OidcError("the ID token's signature does not verify")
        try:  # the signature holds: now its claims (PyJWT checks each one it is told to)
            claims: dict[str, Any] = jwt.decode(
                id_token,
                audience=self.client_id,
                issuer=self.issuer,
                leeway=LEEWAY,
                options={
                    "verify_signature": False,  # verified above, with the issuer's key
                    "verify_exp": True,
                    "verify_iat": True,
                    "verify_nbf": True,
                    "verify_aud": True,
                    "verify_iss": True,
                    "require": ["iss", "aud", "exp", "iat", "sub"],
                },
            )
        except jwt.ExpiredSignatureError:
            raise OidcError("the ID token has expired") from None
        except jwt.InvalidAudienceError:
            raise OidcError("the ID token is not for this hub (aud)") from None
        except jwt.InvalidIssuerError:
            raise OidcError("the ID token is from another issuer (iss)") from None
        except jwt.PyJWTError as exc:
            raise OidcError(f"the ID token is refused: {type(exc).__name__}") from None
        aud = claims.get("aud")
        if isinstance(aud, list) and len(aud) > 1 and claims.get("azp") != self.client_id:
            raise OidcError("the ID token is not for this hub (azp)")
        found = claims.get("nonce")
        if not isinstance(found, str) or not hmac.compare_digest(found, nonce):
            raise OidcError("the ID token's nonce is not this sign-in's")
        return claims


def _find_key(keys: dict[str | None, rsa.PublicKey], kid: Any) -> rsa.PublicKey | None:
    if kid is None:
        return next(iter(keys.values())) if len(keys) == 1 else None
    return keys.get(kid) if isinstance(kid, str) else None


def _b64(text: str) -> bytes:
    """base64url without padding (RFC 7515 §2) to bytes; ValueError when it is not."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _rsa_keys(doc: dict[str, Any]) -> dict[str | None, rsa.PublicKey]:
    """The RSA signing keys of a JWKS (RFC 7517), by key id; others are passed over."""
    import rsa

    keys: dict[str | None, rsa.PublicKey] = {}
    found = doc.get("keys")
    for jwk in found[:MAX_KEYS] if isinstance(found, list) else []:
        if not isinstance(jwk, dict) or jwk.get("kty") != "RSA" or jwk.get("use", "sig") != "sig":
            continue
        kid = jwk.get("kid")
        try:
            n = int.from_bytes(_b64(jwk["n"]), "big")
            e = int.from_bytes(_b64(jwk["e"]), "big")
        except (KeyError, TypeError, ValueError):
            continue
        if n.bit_length() >= 2048 and e > 1 and (kid is None or isinstance(kid, str)):
            keys[kid] = rsa.PublicKey(n, e)
    return keys


def _person(claims: dict[str, Any], groups_claim: str) -> Person:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub or len(sub) > 255:
        raise OidcError("the ID token has no usable sub")
    email = claims.get("email")
    name = claims.get("name")
    raw = claims.get(groups_claim)
    if isinstance(raw, str):
        groups: tuple[str, ...] = (raw,)
    elif isinstance(raw, list):
        groups = tuple(g for g in raw if isinstance(g, str))
    else:
        groups = ()
    return Person(
        sub=sub,
        email=email[:320] if isinstance(email, str) else None,
        name=name[:200] if isinstance(name, str) else None,
        groups=groups,
    )


async def _read_bounded(resp: httpx.Response, what: str) -> bytes:
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > MAX_ANSWER:
            raise OidcError(f"the OIDC issuer's {what} is larger than {MAX_ANSWER} bytes")
    return bytes(body)


def _json_object(body: bytes, what: str, status: int) -> dict[str, Any]:
    if status != 200:
        raise OidcError(f"the OIDC issuer answered HTTP {status} for its {what}")
    try:
        doc = json.loads(body)
    except ValueError:
        raise OidcError(f"the OIDC issuer's {what} is not JSON") from None
    if not isinstance(doc, dict):
        raise OidcError(f"the OIDC issuer's {what} is not a JSON object")
    return doc
