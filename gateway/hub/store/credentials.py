"""The hub's secrets at rest: new bearer tokens, the hashes the store keeps instead of them, a
key's id, and the admin token's owner-only file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import secrets

from gateway.privatefs import make_private_dirs

RUNNER_TOKEN_PREFIX = "alpr_"
API_KEY_PREFIX = "alpk_"
ADMIN_TOKEN_PREFIX = "alpa_"
ENROLLMENT_TOKEN_PREFIX = "alpe_"


def new_token(prefix: str) -> str:
    """A fresh bearer secret with a readable prefix (``alpr_``, ``alpk_``, ``alpa_``, ``alpe_``)."""
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """The SHA-256 hex digest under which a secret is stored."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def key_id_of(key_hash: str) -> str:
    """An API key's id: the start of its hash, unique per key (a new key with a revoked key's
    name has another), not a secret, never the key itself."""
    return key_hash[:16]


def ensure_private_dir(path: pathlib.Path) -> None:
    """Create ``path`` (and parents) if needed and make it owner-only (0700)."""
    make_private_dirs(path)  # each missing parent 0700 too, whatever the umask
    os.chmod(path, 0o700)


def read_admin_token(data_dir: pathlib.Path) -> str | None:
    """The admin token in ``data_dir/admin-token``, or None when there is none."""
    try:
        token = (data_dir / "admin-token").read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return token or None


def write_admin_token(data_dir: pathlib.Path, token: str) -> None:
    """Keep ``token`` in ``data_dir/admin-token``, owner-only (0600, in a 0700 directory)."""
    ensure_private_dir(data_dir)
    path = data_dir / "admin-token"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an empty leftover file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    os.chmod(path, 0o600)


def load_or_create_admin_token(data_dir: pathlib.Path) -> tuple[str, bool]:
    """The admin token stored in ``data_dir/admin-token`` (0600), creating it at first start.

    Returns ``(token, created)``.
    """
    ensure_private_dir(data_dir)
    token = read_admin_token(data_dir)
    if token is not None:
        return token, False
    token = new_token(ADMIN_TOKEN_PREFIX)
    write_admin_token(data_dir, token)
    return token, True
