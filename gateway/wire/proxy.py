"""Which proxy the environment names for an origin: ``*_PROXY`` and ``NO_PROXY`` read as httpx reads them, CIDR ranges too.

Pure (no I/O, no trio): ``proxy_for(scheme, host, port, env)`` is the one place every request
of a backend (turns, health checks, model listing, doctor) learns whether it goes direct.

The variables, as ``urllib.request.getproxies_environment`` (httpx's source) reads them:
``{scheme}_proxy`` for ``http`` and ``https`` origins, else ``all_proxy``; each name in lower
case wins over upper case, and a lower-case one set empty means "none" even when the upper-case
one is set; under CGI (``REQUEST_METHOD`` set) ``HTTP_PROXY`` in upper case is ignored. A value
without ``://`` is an ``http://`` URL; ``user:password@`` in it becomes ``Proxy-Authorization``.

``NO_PROXY`` (same case rules) is a comma-separated list; an origin matching any entry goes
direct. Entries, as httpx matches them:

- ``*``: every origin.
- ``example.com``: that host and its subdomains (not ``notexample.com``).
- ``.example.com``: its subdomains only.
- ``localhost``: that name only.
- ``192.168.1.5``, ``::1``: that address.
- ``host:port`` (``[v6]:port``): the host above, on that port only.
- ``http://host[:port]``, ``all://host``: a URL: that scheme (``all``: any) and that host
  exactly (``*.example.com``: its subdomains), on any port unless one is given.

Where we deliberately differ from httpx 0.28 (each a case httpx gets wrong or rejects):

- ``10.0.0.0/8``, ``fd00::/8``: a CIDR range matches every address in it. httpx matches only
  the network's own address (it reads ``/8`` as a path), so ``NO_PROXY=127.0.0.0/8`` sent a
  loopback health check through the proxy. curl (7.86+), Go and requests match ranges.
- ``*.example.com``: subdomains, as ``.example.com`` (httpx matches nothing).
- ``[::1]``: a bracketed IPv6 address (httpx raises ``InvalidURL``).
- ``host:80`` matches ``http://host`` (httpx compares the port given with the URL's, which
  it leaves unset when it is the scheme's default, so an entry naming 80 or 443 never matches).
- An address matches only addresses and ranges: a name entry is never suffix-matched against
  an IP literal (httpx's ``0.1`` matches ``10.0.0.1``).
- Only the environment is read: no Windows registry or macOS system settings (urllib's
  ``getproxies`` falls back on them when the environment names no proxy).
- Only ``http://`` proxies (no ``https://`` or ``socks5://`` proxy): another is a
  ``ValueError``, raised when the proxy would be used.
"""

from __future__ import annotations

import base64
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Proxy:
    """An ``http://`` proxy: where it listens and the ``Proxy-Authorization`` its URL carries."""

    host: str
    port: int
    authorization: bytes | None = None


def proxy_for(
    scheme: str, host: str, port: int, env: Mapping[str, str] | None = None
) -> Proxy | None:
    """The proxy ``env`` (default: ``os.environ``) names for ``scheme://host:port``; None: direct.

    ``ValueError`` when the proxy named is one this client cannot speak (not ``http://``).
    """
    variables = environment_proxies(os.environ if env is None else env)
    url = variables.get(scheme) or variables.get("all")
    if not url or bypassed(variables.get("no", ""), scheme, host, port):
        return None
    return parse_proxy(url)


def environment_proxies(env: Mapping[str, str]) -> dict[str, str]:
    """``{"http": url, "https": url, "all": url, "no": list}`` from ``*_proxy`` variables, as
    ``urllib.request.getproxies_environment`` reads them (lower case wins, even when empty)."""
    found: dict[str, str] = {}
    for name, value in env.items():
        lower = name.lower()
        if value and lower.endswith("_proxy"):
            found[lower[:-6]] = value
    if "REQUEST_METHOD" in env:  # CGI: HTTP_PROXY may come from a client's "Proxy:" header
        found.pop("http", None)
    for name, value in env.items():
        if name.endswith("_proxy"):
            if value:
                found[name[:-6].lower()] = value
            else:
                found.pop(name[:-6].lower(), None)
    return found


def parse_proxy(url: str) -> Proxy:
    """An ``http://[user:password@]host[:port]`` proxy URL (``host:port`` alone too)."""
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"unsupported proxy {parts.scheme}://{parts.hostname or ''} (only http://)"
        )
    authorization = None
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        authorization = b"Basic " + base64.b64encode(credentials)
    return Proxy(parts.hostname, parts.port or 80, authorization)


def bypassed(no_proxy: str, scheme: str, host: str, port: int) -> bool:
    """Whether a ``NO_PROXY`` list names ``scheme://host:port`` (the module doc has the rules)."""
    host = host.lower().strip("[]")
    address = _address(host)
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        url = "://" in entry
        if url:
            want_scheme, entry = entry.split("://", 1)
            if want_scheme not in ("all", scheme):
                continue
            entry = entry.split("/", 1)[0] if not _is_network(entry) else entry
        name, want_port = _split_port(entry)
        if want_port is not None and want_port != port:
            continue
        if _host_matches(name, host, address, exact=url):
            return True
    return False


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_network(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return False
    return True


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` → (host, port); ``[v6]:port`` too; a bare IPv6 address has no port."""
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        return name, _port(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        name, _, port = entry.partition(":")
        return name, _port(port)
    return entry, None


def _port(text: str) -> int:
    return int(text) if text.isdigit() else -1  # not a port: the entry names no origin


def _host_matches(
    pattern: str,
    host: str,
    address: ipaddress.IPv4Address | ipaddress.IPv6Address | None,
    *,
    exact: bool,
) -> bool:
    if pattern in ("", "*"):  # ``http://``, ``all://*``, ``*:8000``: every host
        return True
    if address is not None:  # an IP literal: only an address or a range names it
        try:
            return address in ipaddress.ip_network(pattern, strict=False)
        except ValueError:
            return False
    if pattern.startswith("*."):  # subdomains only
        return host.endswith(pattern[1:])
    if pattern.startswith("*"):  # httpx's ``*example.com``: the domain and its subdomains
        pattern = pattern[1:]
        return host == pattern or host.endswith("." + pattern)
    if pattern.startswith("."):
        return host.endswith(pattern)
    if exact or pattern == "localhost":
        return host == pattern
    return host == pattern or host.endswith("." + pattern)
