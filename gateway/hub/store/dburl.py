"""A PostgreSQL URL as the hub's store says it: the password in it never shown (pure, no I/O).

The URL (``postgresql://USER:PASSWORD@HOST:PORT/DATABASE?...``) may carry a password, in its
user part or as a ``password=`` parameter; ``redact`` gives the URL with each replaced by
``***`` (what every message and log line names the store by), and ``scrub`` takes them out of a
text that may quote the URL (libpq's own messages do). A password kept out of the URL, in
``PGPASSWORD`` or ``~/.pgpass`` as libpq reads them, is never seen here at all."""

from __future__ import annotations

import urllib.parse

SCHEMES = ("postgresql", "postgres")  # what libpq takes as a URL
HIDDEN = "***"


def is_url(place: object) -> bool:
    """Whether ``place`` is a PostgreSQL URL (not a data directory)."""
    return isinstance(place, str) and place.partition("://")[0].lower() in SCHEMES


def redact(url: str) -> str:
    """``url`` with its password (in the user part, or a ``password=`` parameter) as ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return f"{url.partition('://')[0]}://{HIDDEN}"  # unparsable: nothing of it is shown
    netloc = parts.netloc
    user, at, hosts = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:{HIDDEN}@{hosts}"
    query = "&".join(
        f"{pair.partition('=')[0]}={HIDDEN}"
        if pair.partition("=")[0].lower() == "password"
        else pair
        for pair in parts.query.split("&")
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def secrets(url: str) -> list[str]:
    """The passwords ``url`` holds, as written and percent-decoded (longest first)."""
    found: set[str] = set()
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        parts = None
    if parts is not None:
        user, at, _hosts = parts.netloc.rpartition("@")
        if at and ":" in user:
            found.add(user.partition(":")[2])
        for pair in parts.query.split("&"):
            name, _, value = pair.partition("=")
            if name.lower() == "password":
                found.add(value)
    else:  # a URL too broken to split: whatever follows the user's colon is hidden
        userinfo = url.partition("://")[2].rpartition("@")[0]
        if ":" in userinfo:
            found.add(userinfo.partition(":")[2])
    found |= {urllib.parse.unquote(s) for s in found}
    found.discard("")
    return sorted(found, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` with every password of ``url`` in it replaced by ``***``."""
    for secret in secrets(url):
        text = text.replace(secret, HIDDEN)
    return text
