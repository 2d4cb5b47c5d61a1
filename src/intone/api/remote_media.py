"""Reference audio from http(s) URLs (`--allow-remote-media`), guarded against server-side request forgery.

Every hop (the URL, then each redirect, followed by hand) is resolved first, and refused unless every
address it resolves to is a public one: loopback, private, link-local (cloud metadata services),
multicast, unspecified and reserved addresses never see a request from us. `--allow-private-media`
admits loopback and private networks (an on-premises media host), never the others. The whole
download, redirects and body included, has one deadline, and network failures read alike, so the
errors do not tell which internal ports are open.

Known gap: the host is resolved again when httpx connects, so a DNS server answering differently
the second time (rebinding) is not caught; deployments that fetch from untrusted URLs should also
firewall the server's egress.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlparse

import httpx

from intone.errors import InvalidRequestError, MediaTooLarge

MAX_REDIRECTS = 5
UNREACHABLE = "cannot download it: no answer in time, or the connection failed"


def refused(address: str, allow_private: bool) -> bool:
    """Whether a request to this IP address must not be made."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified or (ip.is_reserved and not ip.is_loopback):
        return True
    if allow_private and (ip.is_loopback or ip.is_private):
        return False
    return not ip.is_global


async def _check_host(url: str, field: str, allow_private: bool) -> None:
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(field, "only http(s) URLs with a host can be downloaded")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        raise InvalidRequestError(field, UNREACHABLE) from None
    if not infos or any(refused(info[4][0], allow_private) for info in infos):
        raise InvalidRequestError(field, "refused: the URL's host is not a public address")


async def download(url: str, field: str, policy) -> bytes:
    """The body at url (at most policy.max_bytes), or InvalidRequestError(field, ...)."""
    try:
        async with asyncio.timeout(policy.remote_timeout_s):
            async with httpx.AsyncClient(timeout=policy.remote_timeout_s, follow_redirects=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    await _check_host(url, field, policy.allow_private)
                    async with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = urljoin(url, response.headers.get("location", ""))
                            continue
                        if response.status_code >= 400:
                            raise InvalidRequestError(field, f"cannot download it: the server answered "
                                                             f"HTTP {response.status_code}")
                        data = bytearray()
                        async for part in response.aiter_bytes():
                            data += part
                            if len(data) > policy.max_bytes:
                                raise MediaTooLarge(field, f"download is over the {policy.max_bytes} byte limit")
                        return bytes(data)
                raise InvalidRequestError(field, f"cannot download it: more than {MAX_REDIRECTS} redirects")
    except (httpx.HTTPError, TimeoutError, OSError):
        raise InvalidRequestError(field, UNREACHABLE) from None
