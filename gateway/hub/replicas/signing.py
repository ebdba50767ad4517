"""How replicas sign their internal requests to each other with the team's secret, and how the
receiver checks one: HMAC-SHA256 over the method, the path, a timestamp, a nonce and the body's
SHA-256, refused outside ``WINDOW`` s of the receiver's clock and refused a second time within
it (a sniffed request cannot be replayed). Pure: no I/O, the clock given.

The header: ``x-alp-replica: <unix time>.<nonce>.<signature hex>``, beside
``x-alp-body-sha256: <hex>``; the signature is checked before the body is read, the body's
digest once it is."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

SIGNATURE = b"x-alp-replica"
BODY_DIGEST = b"x-alp-body-sha256"
WINDOW = 30.0  # s either side of the receiver's clock a signed request is taken within
MAX_SEEN = 65536  # signatures remembered at most (a flood cannot grow it): the oldest go first
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest() if body else EMPTY_DIGEST


def _mac(secret: str, method: str, path: str, stamp: str, nonce: str, digest: str) -> str:
    message = "\n".join((method, path, stamp, nonce, digest)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, path: str, body: bytes, now: float) -> list[tuple[bytes, bytes]]:
    """The headers of one signed request (a fresh nonce each)."""
    stamp, nonce, digest = str(int(now)), secrets.token_hex(12), body_digest(body)
    mac = _mac(secret, method, path, stamp, nonce, digest)
    return [(SIGNATURE, f"{stamp}.{nonce}.{mac}".encode()), (BODY_DIGEST, digest.encode())]


class Verifier:
    """The receiver's check: ``secrets`` (each accepted), the signatures seen within the
    window (each taken once)."""

    def __init__(self, team_secrets: tuple[str, ...], window: float = WINDOW) -> None:
        self.secrets = team_secrets
        self.window = window
        self._seen: OrderedDict[str, float] = OrderedDict()  # signature -> its timestamp

    def check(
        self, header: bytes | None, digest: bytes | None, method: str, path: str, now: float
    ) -> str | None:
        """None when the request is signed with a team secret, within the window, and not seen
        before (then it is remembered); else why not, in one line that names no secret."""
        if header is None or digest is None:
            return "a signed request of another replica is required"
        try:
            stamp, nonce, mac = header.decode("ascii").split(".")
            at = int(stamp)
            expected_digest = digest.decode("ascii")
        except (UnicodeDecodeError, ValueError):
            return "a malformed replica signature"
        if abs(now - at) > self.window:
            return f"a replica signature outside the {self.window:g} s window (clocks apart?)"
        matched = False
        for secret in self.secrets:
            want = _mac(secret, method, path, stamp, nonce, expected_digest)
            matched |= hmac.compare_digest(want, mac)
        if not matched:
            return "not signed with the team secret"
        if mac in self._seen:
            return "a replayed replica request"
        self._remember(mac, at, now)
        return None

    def _remember(self, mac: str, at: float, now: float) -> None:
        seen = self._seen
        while seen and (len(seen) >= MAX_SEEN or next(iter(seen.values())) < now - self.window):
            seen.popitem(last=False)
        seen[mac] = at
