"""PyInstaller runtime hook: find this machine's CA certificates when the bundled OpenSSL's built-in path has none.

The binary carries the build machine's libssl, which looks for CAs where the build distribution
keeps them (Debian: /usr/lib/ssl). On a distribution that keeps them elsewhere (Fedora, openSUSE,
Alpine, ...), point SSL_CERT_FILE at the local bundle; failing that, at certifi's bundled copy.
An SSL_CERT_FILE or SSL_CERT_DIR that is already set always wins.
"""

import os
import ssl
import sys

SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Arch, Alpine, Gentoo
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL, CentOS
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  # Fedora, RHEL (the source of the above)
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ssl/cert.pem",  # Alpine, BSDs
)


def _has_default_cas() -> bool:
    paths = ssl.get_default_verify_paths()
    if paths.cafile and os.path.isfile(paths.cafile):
        return True
    try:
        return bool(paths.capath and os.listdir(paths.capath))
    except OSError:
        return False


def _ca_bundle() -> str | None:
    if os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR") or _has_default_cas():
        return None
    for path in SYSTEM_BUNDLES:
        if os.path.isfile(path):
            return path
    bundled = os.path.join(getattr(sys, "_MEIPASS", ""), "certifi", "cacert.pem")
    return bundled if os.path.isfile(bundled) else None


_bundle = _ca_bundle()
if _bundle is not None:
    os.environ["SSL_CERT_FILE"] = _bundle
