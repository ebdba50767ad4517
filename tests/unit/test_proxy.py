"""Proxies from the environment (gateway.wire.proxy): the cases httpx documents and handles, as a
table, and the ones where we deliberately differ (each marked ``DIFFERS``: httpx's answer beside).

Every row not marked was checked against httpx 0.28.1 (``Client()._transport_for_url``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from gateway.wire import proxy
from gateway.wire.proxy import Proxy, proxy_for

P = "http://p:1"
VIA_P = Proxy("p", 1)
VIA_Q = Proxy("q", 2)
DIRECT = None

CASES: list[tuple[dict[str, str], str, Proxy | None]] = [
    # which variable names the proxy
    ({}, "http://gpu.lan", DIRECT),
    ({"HTTP_PROXY": "q:2"}, "http://gpu.lan:8000", VIA_Q),  # no scheme: http://
    ({"http_proxy": P}, "http://gpu.lan:8000", VIA_P),
    ({"http_proxy": P, "HTTP_PROXY": "http://q:2"}, "http://gpu.lan", VIA_P),  # lower case wins
    ({"http_proxy": "", "HTTP_PROXY": "http://q:2"}, "http://gpu.lan", DIRECT),  # even empty
    ({"HTTP_PROXY": P}, "https://api.openai.com", DIRECT),  # https wants HTTPS_PROXY
    ({"HTTPS_PROXY": P}, "https://api.openai.com", VIA_P),
    ({"HTTPS_PROXY": P}, "http://api.openai.com", DIRECT),
    ({"ALL_PROXY": P}, "https://api.openai.com", VIA_P),
    ({"ALL_PROXY": P}, "http://api.openai.com", VIA_P),
    ({"ALL_PROXY": P, "HTTPS_PROXY": "http://q:2"}, "https://a.b", VIA_Q),  # scheme's wins
    ({"all_proxy": P, "HTTPS_PROXY": "http://q:2"}, "https://a.b", VIA_Q),  # whatever the case
    ({"HTTP_PROXY": P, "REQUEST_METHOD": "GET"}, "http://a.b", DIRECT),  # CGI: not trusted
    ({"http_proxy": P, "REQUEST_METHOD": "GET"}, "http://a.b", VIA_P),
    # NO_PROXY: everything
    ({"ALL_PROXY": P, "NO_PROXY": "*"}, "http://a", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "a.b, *"}, "http://a", DIRECT),
    # hosts and domains
    ({"ALL_PROXY": P, "NO_PROXY": "openai.com"}, "https://openai.com", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "openai.com"}, "https://api.openai.com", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "openai.com"}, "https://notopenai.com", VIA_P),
    ({"ALL_PROXY": P, "NO_PROXY": "OpenAI.com"}, "https://api.openai.com", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": ".openai.com"}, "https://api.openai.com", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": ".openai.com"}, "https://openai.com", VIA_P),
    ({"ALL_PROXY": P, "NO_PROXY": "localhost"}, "http://localhost:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "localhost"}, "http://my.localhost:8000", VIA_P),
    ({"ALL_PROXY": P, "no_proxy": "gpu.lan", "NO_PROXY": "other"}, "http://gpu.lan", DIRECT),
    ({"ALL_PROXY": P, "no_proxy": "", "NO_PROXY": "gpu.lan"}, "http://gpu.lan", VIA_P),
    # addresses
    ({"ALL_PROXY": P, "NO_PROXY": "localhost,127.0.0.1"}, "http://127.0.0.1", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "127.0.0.1"}, "http://localhost:8000", VIA_P),  # no DNS
    ({"ALL_PROXY": P, "NO_PROXY": "::1"}, "http://[::1]:8000", DIRECT),
    # ports
    ({"ALL_PROXY": P, "NO_PROXY": "gpu.lan:8000"}, "http://gpu.lan:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "gpu.lan:9000"}, "http://gpu.lan:8000", VIA_P),
    ({"ALL_PROXY": P, "NO_PROXY": "127.0.0.1:8000"}, "http://127.0.0.1:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "127.0.0.1:9000"}, "http://127.0.0.1:8000", VIA_P),
    # URLs: a scheme, an exact host, any port unless one is given
    ({"ALL_PROXY": P, "NO_PROXY": "http://gpu.lan"}, "http://gpu.lan:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "http://gpu.lan"}, "https://gpu.lan", VIA_P),
    ({"ALL_PROXY": P, "NO_PROXY": "http://gpu.lan"}, "http://a.gpu.lan", VIA_P),
    ({"ALL_PROXY": P, "NO_PROXY": "all://gpu.lan"}, "https://gpu.lan", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "http://127.0.0.1,python-httpx.org"}, "http://127.0.0.1", DIRECT),
    (
        {"ALL_PROXY": P, "NO_PROXY": "http://127.0.0.1,python-httpx.org"},
        "http://example.com",
        VIA_P,
    ),
    ({"ALL_PROXY": P, "NO_PROXY": "http://gpu.lan:8000"}, "http://gpu.lan:9000", VIA_P),
    # DIFFERS: CIDR ranges (httpx: only the network's own address goes direct)
    ({"ALL_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, "http://10.1.2.3:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, "http://10.0.0.0:8000", DIRECT),  # as httpx
    ({"ALL_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, "http://11.0.0.1:8000", VIA_P),  # as httpx
    ({"ALL_PROXY": P, "NO_PROXY": "127.0.0.0/8"}, "http://127.0.0.1:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "192.168.0.0/16"}, "https://192.168.7.9", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "fd00::/8"}, "http://[fd12::3]:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, "http://gpu.lan", VIA_P),  # as httpx: no DNS
    # DIFFERS: *.domain (httpx: matches nothing)
    ({"ALL_PROXY": P, "NO_PROXY": "*.openai.com"}, "https://api.openai.com", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "*.openai.com"}, "https://openai.com", VIA_P),  # as httpx
    # DIFFERS: a bracketed IPv6 address, with or without a port (httpx: InvalidURL)
    ({"ALL_PROXY": P, "NO_PROXY": "[::1]"}, "http://[::1]:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "[::1]:8000"}, "http://[::1]:8000", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "[::1]:9000"}, "http://[::1]:8000", VIA_P),
    # DIFFERS: the scheme's default port given (httpx: never matches)
    ({"ALL_PROXY": P, "NO_PROXY": "gpu.lan:80"}, "http://gpu.lan", DIRECT),
    ({"ALL_PROXY": P, "NO_PROXY": "gpu.lan:443"}, "https://gpu.lan", DIRECT),
    # DIFFERS: a name is never suffix-matched against an address (httpx: direct)
    ({"ALL_PROXY": P, "NO_PROXY": "0.1"}, "http://10.0.0.1", VIA_P),
]


@pytest.mark.parametrize(("env", "url", "expected"), CASES)
def test_proxy_from_the_environment(env: dict[str, str], url: str, expected: Proxy | None) -> None:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}[parts.scheme]
    assert proxy_for(parts.scheme, parts.hostname or "", port, env) == expected


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", P)
    assert proxy_for("http", "gpu.lan", 80) == VIA_P
    monkeypatch.setenv("NO_PROXY", "10.0.0.0/8")
    assert proxy_for("http", "10.9.9.9", 80) is DIRECT


def test_proxy_credentials_become_basic_authorization() -> None:
    found = proxy_for("http", "gpu.lan", 80, {"HTTP_PROXY": "http://us%40r:p%3Ass@p:3128"})
    assert found is not None and (found.host, found.port) == ("p", 3128)
    assert found.authorization == b"Basic dXNAcjpwOnNz"  # base64 of "us@r:p:ss"


def test_a_proxy_without_a_port_listens_on_80() -> None:
    assert proxy.parse_proxy("http://p") == Proxy("p", 80)


@pytest.mark.parametrize("url", ["socks5://p:1080", "https://p:3128"])
def test_only_http_proxies(url: str) -> None:
    with pytest.raises(ValueError, match=r"only http://"):
        proxy_for("https", "api.openai.com", 443, {"HTTPS_PROXY": url})


def test_a_bypassed_origin_never_reads_the_proxy_url() -> None:
    # an unusable proxy is no error for an origin that does not go through it
    assert (
        proxy_for("https", "gpu.lan", 443, {"HTTPS_PROXY": "socks5://p", "NO_PROXY": "*"}) is None
    )
