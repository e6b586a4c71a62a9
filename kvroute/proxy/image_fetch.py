"""Images by http(s) URL: fetched by the proxy, when its operator enables it, and
inlined before anything else reads the request.

Every API reaches the routing as a chat body (Responses' `input_image` and Messages'
`url` image sources become chat `image_url` parts), so one step covers all three:
each image part whose URL is http(s) is fetched and rewritten into the `data:` URL of
the bytes it got, before the prefix chain is computed. From there on (prefix keys,
routing, the backend) the request is exactly the one the client would have sent with
the image inline: the same bytes by URL or inline give the same keys and hit the same
cache. Backends never fetch.

Off by default (`--fetch-images`): a proxy that fetches what clients name is a way
into the network it stands in. When on, each fetch is held to limits: http and https
only, at most MAX_REDIRECTS redirects (each hop checked anew), a total time per image
(redirects included), a byte cap (reading stops past it), PNG or JPEG by Content-Type
and by the bytes themselves, PER_REQUEST fetches of one request at once. An address a
public image never needs (loopback, private, link-local, multicast, reserved, and the
IPv4 such an IPv6 address embeds) is refused unless `--fetch-images-allow` names its
host or a network holding it. The check is on the addresses the connection is made
to: names resolve through `_CheckedResolver`, which drops refused addresses before
the connector sees them, so a name that resolves to a public address when checked and
to a private one when connecting (DNS rebinding) cannot get through; address literals
(which aiohttp does not resolve) are checked before the request. A request may have
at most MAX_URLS distinct image URLs fetched.

Every refusal is a 400 `invalid_image` naming the URL's host (`param` messages; the
agent APIs reword it as they reword any refusal of their chat body).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any, Iterable

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from kvroute.api.errors import APIError, bad_request
from kvroute.core.images import FORMATS, MAX_IMAGE_BYTES, image_parts, image_url_of

log = logging.getLogger("kvroute.proxy.images")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_REDIRECTS = 3
PER_REQUEST = 4  # fetches of one request in flight at once
# Distinct URLs one request may have fetched (Anthropic's API takes 100 images a
# request): a bound on the fetches, and the time, one request can cost.
MAX_URLS = 100
CHUNK = 64 << 10
REDIRECTS = {301, 302, 303, 307, 308}
SCHEMES = ("http", "https")
# IPv6 prefixes that carry an IPv4 address a gateway may deliver to: NAT64's well-known one.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HEADERS = {"Accept": "image/png, image/jpeg", "Accept-Encoding": "identity",
            "User-Agent": "kvroute-image-fetch"}


@dataclass(frozen=True)
class FetchSettings:
    enabled: bool = False
    allow: tuple[str, ...] = ()  # host names and networks (CIDR or single addresses)
    timeout: float = 10.0  # seconds per image, redirects included
    max_bytes: int = MAX_IMAGE_BYTES  # of one image's body


# -- which addresses --------------------------------------------------------------------


def _views(ip: IPAddress) -> Iterable[IPAddress]:
    """The address, and the IPv4 address an IPv6 one carries (mapped, 6to4, NAT64):
    ::ffff:127.0.0.1 reaches loopback as surely as 127.0.0.1 does."""
    yield ip
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            yield embedded


def is_public(ip: IPAddress) -> bool:
    """Whether an image URL may reach `ip` without the operator allowing it: not
    loopback, private, link-local, multicast, reserved, unspecified or otherwise
    not global, by itself nor by the IPv4 address it embeds."""
    # A mapped address is its IPv4 address written as IPv6: judged as that alone (some
    # Pythons call the whole ::ffff:0:0/96 private).
    mapped = ip.ipv4_mapped if ip.version == 6 else None
    for a in [mapped] if mapped is not None else _views(ip):
        if (not a.is_global or a.is_private or a.is_loopback or a.is_link_local
                or a.is_multicast or a.is_reserved or a.is_unspecified
                or (a.version == 6 and a.is_site_local)):
            return False
    return True


def parse_address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


class Policy:
    """Which hosts and addresses fetching may reach: public addresses, and what
    `allow` names (a host name: whatever it resolves to; a network: its addresses)."""

    def __init__(self, allow: Iterable[str]):
        self.hosts: set[str] = set()
        self.nets: list[IPNetwork] = []
        for item in allow:
            try:
                self.nets.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                self.hosts.add(_host_name(item))

    def permits(self, host: str, address: str) -> bool:
        if _host_name(host) in self.hosts:
            return True
        ip = parse_address(address.split("%", 1)[0])
        if ip is None:
            return False
        if any(v in net for v in _views(ip) for net in self.nets if v.version == net.version):
            return True
        return is_public(ip)


def _host_name(host: str) -> str:
    return host.strip().lower().rstrip(".")


class Blocked(OSError):
    """A host whose every address the policy refuses."""


class _CheckedResolver(AbstractResolver):
    """Resolves as the system does, keeping only the addresses the policy permits: the
    connector connects to what this returns, so the checked address is the one used."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        kept = [r for r in found if self.policy.permits(host, r["host"])]
        if not kept:
            raise Blocked(f"{host} resolves to no address this proxy may fetch from")
        return kept

    async def close(self) -> None:
        await self.inner.close()


# -- fetching ---------------------------------------------------------------------------


class FetchError(Exception):
    """Why an image URL was not used (the client's 400 names the host with it)."""

    def __init__(self, host: str, reason: str):
        super().__init__(reason)
        self.host, self.reason = host, reason


def refusal(host: str, reason: str) -> APIError:
    return bad_request(f"Invalid image: the image at {host or 'that URL'} could not be used: "
                       f"{reason}.", param="messages", code="invalid_image")


def disabled(host: str) -> APIError:
    return bad_request(
        f"Invalid image: image URLs are not fetched by this proxy (fetching is disabled; "
        f"got a URL on {host or 'no host'}). Send the image inline as "
        "data:image/png;base64,..., or ask the operator to enable --fetch-images.",
        param="messages", code="invalid_image")


def url_host(url: str) -> str:
    try:
        return URL(url).host or ""
    except (ValueError, TypeError):
        return ""


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].strip().lower() if ":" in url else ""


def _handled(url: Any, enabled: bool) -> bool:
    """An image URL this step handles: with fetching on, any string that is not a data:
    URL (a scheme other than http(s) is refused here, with a reason that says so); with
    it off, http(s) ones (refused as not fetched). The rest is core/images.py's."""
    if not isinstance(url, str):
        return False
    scheme = _scheme(url)
    return scheme != "data" if enabled else scheme in SCHEMES


class ImageFetcher:
    """The proxy's image fetching: `inline(body)` rewrites a chat body's image URLs
    into data: URLs (a 400 for any it cannot use). One session, started with the app."""

    def __init__(self, settings: FetchSettings):
        self.settings = settings
        self.policy = Policy(settings.allow)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if not self.settings.enabled:
            return
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.policy), limit=64)
        # No cookies, no proxy from the environment, bytes as sent (the cap counts them).
        self.session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def inline(self, body: dict) -> int:
        """Rewrite every http(s) image URL of the body's messages into the data: URL of
        its image; how many distinct URLs were fetched (0: the body is unchanged)."""
        on = self.session is not None
        parts = [p for p in image_parts(body.get("messages")) if _handled(image_url_of(p), on)]
        if not parts:
            return 0
        urls = list(dict.fromkeys(image_url_of(p) for p in parts))
        if not on:
            raise disabled(url_host(urls[0]))
        if len(urls) > MAX_URLS:
            raise bad_request(f"Invalid image: the request has {len(urls)} image URLs; this "
                              f"proxy fetches at most {MAX_URLS} a request (send the others "
                              "inline).", param="messages", code="invalid_image")
        gate = asyncio.Semaphore(PER_REQUEST)
        got: dict[str, str] = {}

        async def one(url: str) -> None:
            async with gate:
                got[url] = await self.fetch(url)

        try:
            async with asyncio.TaskGroup() as tasks:
                for url in urls:
                    tasks.create_task(one(url))
        except BaseExceptionGroup as group:
            # The first refusal answers; the other fetches were cancelled with it.
            first = group.exceptions[0]
            raise first if isinstance(first, APIError) else group
        for part in parts:
            ref = part["image_url"]
            url = got[image_url_of(part)]
            part["image_url"] = {**ref, "url": url} if isinstance(ref, dict) else url
        return len(urls)

    async def fetch(self, url: str) -> str:
        """The image at `url` as a data: URL; APIError (400) for anything else."""
        host = url_host(url)
        try:
            async with asyncio.timeout(self.settings.timeout):
                media_type, data = await self._get(url)
        except FetchError as exc:
            log.info("image URL refused (host %s): %s", exc.host, exc.reason)
            raise refusal(exc.host, exc.reason) from None
        except TimeoutError:
            log.info("image URL refused (host %s): timed out", host)
            raise refusal(host, f"the fetch took longer than {self.settings.timeout:g}s") from None
        encoded = await asyncio.to_thread(base64.b64encode, data) if len(data) > 1 << 20 \
            else base64.b64encode(data)
        return f"data:{media_type};base64,{encoded.decode()}"

    async def _get(self, url: str) -> tuple[str, bytes]:
        for _ in range(MAX_REDIRECTS + 1):
            target = self._checked(url)
            host = target.host or ""
            try:
                async with self.session.get(target, allow_redirects=False,
                                            headers=_HEADERS) as resp:
                    if resp.status in REDIRECTS:
                        url = self._next(target, resp)
                        continue
                    return await self._image(host, resp)
            except FetchError:
                raise
            except aiohttp.ClientConnectorDNSError as exc:
                if isinstance(exc.os_error, Blocked):
                    raise _blocked(host) from None
                raise FetchError(host, "the host name could not be resolved") from None
            except aiohttp.ClientConnectorError:
                raise FetchError(host, "no connection could be made to it") from None
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                raise FetchError(host, f"the request failed ({type(exc).__name__})") from None
        raise FetchError(url_host(url), f"more than {MAX_REDIRECTS} redirects")

    def _checked(self, url: str) -> URL:
        """The URL, when its scheme is http(s) and its host, if an address, is allowed."""
        scheme = _scheme(url)
        try:
            target = URL(url)
        except (ValueError, TypeError):
            raise FetchError("", "the URL is not valid") from None
        if scheme not in SCHEMES:
            raise FetchError(target.host or "", f"only http and https URLs are fetched (got "
                             f"{scheme[:10] or 'no scheme'!r})")
        host = target.host or ""
        if not host:
            raise FetchError("", "the URL has no host")
        ip = parse_address(host)
        if ip is not None and not self.policy.permits(host, str(ip)):
            raise _blocked(host)
        return target

    def _next(self, target: URL, resp: aiohttp.ClientResponse) -> str:
        location = resp.headers.get("Location")
        if not location:
            raise FetchError(target.host or "", f"HTTP {resp.status} without a Location")
        try:
            return str(target.join(URL(location)))
        except (ValueError, TypeError):
            raise FetchError(target.host or "", "the redirect's Location is not valid") from None

    async def _image(self, host: str, resp: aiohttp.ClientResponse) -> tuple[str, bytes]:
        if resp.status != 200:
            raise FetchError(host, f"the server answered HTTP {resp.status}")
        media_type = resp.content_type.lower()
        if media_type not in FORMATS:
            raise FetchError(host, f"its Content-Type is {media_type or 'missing'!r}, not "
                             "image/png or image/jpeg")
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise FetchError(host, f"it came {encoding}-encoded; only unencoded images are taken")
        limit = self.settings.max_bytes
        too_large = f"it is over the limit of {limit} bytes"
        if resp.content_length is not None and resp.content_length > limit:
            raise FetchError(host, too_large)
        data = bytearray()
        async for chunk in resp.content.iter_chunked(CHUNK):
            data += chunk
            if len(data) > limit:
                raise FetchError(host, too_large)
        if not bytes(data[:8]).startswith(FORMATS[media_type]):
            raise FetchError(host, f"its bytes are not {media_type}")
        return media_type, bytes(data)


def _blocked(host: str) -> FetchError:
    return FetchError(host, "the host is a loopback, private, link-local or reserved address "
                      "(or resolves only to such), which this proxy does not fetch from unless "
                      "its operator allows it (--fetch-images-allow)")
