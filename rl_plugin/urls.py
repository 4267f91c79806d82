"""URL parsing shared by a flag's check and the client that uses the URL (``--rm-url``)."""

from __future__ import annotations


def url_host_port(url: str):
    """``(host, port)`` of an http(s) URL (the scheme's port when none is given); ``ValueError``
    saying why for anything else."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    try:
        port = parts.port
    except ValueError as exc:  # not a number, or outside 0..65535
        raise ValueError(f"{url!r} has a bad port ({exc})") from None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)
