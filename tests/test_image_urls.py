"""Images by http(s) URL: fetched by the proxy only when its operator enables it,
under limits, never from an address a public image does not need, and inlined so a
URL image and the same bytes inline route to and hit the same cache.

An image server (http.server, in a thread, on a free loopback port) serves the test
images and the misbehaving endpoints; the tiny Gemma 3 VLM runs behind three real
proxies over one Redis: one that fetches with 127.0.0.1 allowed, one that does not
fetch, one that fetches with the default address policy. Clients are the official
openai and anthropic SDKs.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import ipaddress
import threading
import time

import anthropic
import openai
import pytest
from tests import harness
from tests.harness import BackendProcess, ProxyProcess, chat, metric_sum, request
from tests.test_vision import (SYSTEM, conversation, image_url, messages_two_turns_cached,
                               responses_two_turns)

from kvroute import config
from kvroute.api.errors import APIError
from kvroute.core import prefix
from kvroute.devtools import vision_models
from kvroute.proxy.image_fetch import FetchSettings, ImageFetcher, Policy, is_public

SECRET = "image-url-secret"
TIMEOUT = 1.0  # the fetching proxies' --fetch-images-timeout
MAX_BYTES = 256 << 10  # and their --fetch-images-max-bytes
MAX_BODY = 256 << 10  # the fetching proxy's --max-body-bytes: two /big/ images inline pass it


def image_bytes(seed: int, fmt: str = "PNG") -> bytes:
    """The bytes of test_vision's image_url(seed): served here, inline there."""
    return base64.b64decode(image_url(seed, fmt).split(",", 1)[1])


class _Images(http.server.BaseHTTPRequestHandler):
    """/img/SEED.png|jpg, /big/SEED.png (200x200), /to/SEED.png (a redirect to /img/), /to-literal (a redirect to
    127.0.0.1), /slow, /huge (no length, never ends before the cap), /declared (a
    Content-Length past the cap), /html, /lie (PNG said, JPEG sent), /loop, anything
    else 404."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        try:
            if path.startswith("/img/"):
                seed, _, ext = path[5:].partition(".")
                fmt, kind = ("PNG", "png") if ext == "png" else ("JPEG", "jpeg")
                self._send(200, image_bytes(int(seed), fmt), f"image/{kind}")
            elif path.startswith("/big/"):  # 200x200 of noise: about 120 kB
                seed = int(path[5:].partition(".")[0])
                self._send(200, base64.b64decode(image_url(seed, size=200).split(",")[1]),
                           "image/png")
            elif path.startswith("/to/"):
                self._redirect("/img/" + path[4:])
            elif path == "/to-literal":
                self._redirect(f"http://127.0.0.1:{self.server.server_port}/img/1.png")
            elif path == "/loop":
                self._redirect("/loop")
            elif path == "/slow":
                time.sleep(TIMEOUT * 5)
                self._send(200, image_bytes(1), "image/png")
            elif path == "/huge":
                self._huge()
            elif path == "/declared":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(MAX_BYTES * 100))
                self.end_headers()
                self.wfile.write(image_bytes(1))
            elif path == "/html":
                self._send(200, b"<html>not an image</html>", "text/html")
            elif path == "/lie":
                self._send(200, image_bytes(1, "JPEG"), "image/png")
            else:
                self._send(404, b"not found", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the proxy stopped reading: what a limit does

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _huge(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(image_bytes(1))
        for _ in range(MAX_BYTES * 64 // 65536):  # 64 times the cap, then it gives up
            self.wfile.write(b"\0" * 65536)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


@pytest.fixture(scope="module")
def images():
    server = _Server(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def url_fleet(model_cache, tmp_path_factory, redis_server):
    model = vision_models.ensure("gemma3", cache_dir=model_cache)
    logs = tmp_path_factory.mktemp("image-url-logs")
    fetch = ["--fetch-images", "--fetch-images-timeout", str(TIMEOUT),
             "--fetch-images-max-bytes", str(MAX_BYTES)]

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--secret", SECRET, "--prefill-step", "32"]
        return [BackendProcess(model, "vlm", logs, backend_id=f"vlm-url-{i}", extra=common)
                for i in range(2)]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, *fetch,
                                               "--fetch-images-allow", "127.0.0.1",
                                               "--max-body-bytes", str(MAX_BODY)]),
                ProxyProcess(redis_url, logs, ["--secret", SECRET]),
                ProxyProcess(redis_url, logs, ["--secret", SECRET, *fetch])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        fetching, off, strict = f["proxies"]
        yield {"fetching": fetching, "off": off, "strict": strict,
               "backends": list(f["backends"].values())}


def _cached_share(usage: dict) -> float:
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


# -- through the proxy -----------------------------------------------------------------


def _metric(proxy: ProxyProcess, name: str) -> float:
    return metric_sum(request(proxy.url + "/metrics")[2].decode(), name)


def test_chat_url_image_turn2_hits_and_the_same_image_inline_hits_too(url_fleet, images):
    proxy = url_fleet["fetching"]
    fetched = _metric(proxy, "kvroute_proxy_images_fetched_total")
    messages = conversation(f"{images}/img/30.png")
    first = chat(proxy, messages, model="vlm", max_tokens=8, temperature=0)
    backend = first.headers["x-kvroute-backend"]
    messages += [first.message, {"role": "user", "content": "And what is the error message?"}]
    second = chat(proxy, messages, model="vlm", max_tokens=8, temperature=0)
    assert second.headers["x-kvroute-backend"] == backend
    assert _cached_share(second.body["usage"]) >= 0.8, second.body["usage"]

    # The same bytes inline: the same prefix keys, so the same backend and its cache.
    inline = [messages[0], {**messages[1], "content": [messages[1]["content"][0],
                                                       {"type": "image_url",
                                                        "image_url": {"url": image_url(30)}}]},
              *messages[2:]]
    third = chat(proxy, inline, model="vlm", max_tokens=8, temperature=0)
    assert third.headers["x-kvroute-backend"] == backend
    assert _cached_share(third.body["usage"]) >= 0.8, third.body["usage"]
    assert _metric(proxy, "kvroute_proxy_images_fetched_total") == fetched + 2
    assert _metric(proxy, "kvroute_proxy_image_fetch_seconds_count") >= 2


def test_responses_url_image_through_a_redirect_is_cached(url_fleet, images):
    _, second = responses_two_turns(url_fleet["fetching"], f"{images}/to/31.jpg")
    usage = second.usage
    assert usage.input_tokens_details.cached_tokens >= 0.8 * usage.input_tokens, usage


def test_messages_url_source_is_cached_and_counted(url_fleet, images):
    # Turn 2 sends the image as a base64 source: the same bytes, the same cache.
    data = base64.b64encode(image_bytes(32)).decode()
    messages_two_turns_cached(url_fleet["fetching"], {"type": "url", "url": f"{images}/img/32.png"},
                              {"type": "base64", "media_type": "image/png", "data": data})


def _refusals(proxy: ProxyProcess, url: str) -> dict[str, tuple[dict, float]]:
    """The error body each API answers for an image at `url`, and how long it took."""
    out = {}
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        chat(proxy, conversation(url), model="vlm", max_tokens=2)
    out["chat"] = e.value.body, time.monotonic() - t0
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="vlm", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Look."}, {"type": "input_image", "image_url": url}]}])
    out["responses"] = e.value.body, time.monotonic() - t0
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="vlm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}]}])
    out["messages"] = e.value.body, time.monotonic() - t0
    return out


def _assert_refused(proxy: ProxyProcess, url: str, words: str, host: str = "127.0.0.1",
                    within: float = 5.0) -> None:
    for api, (body, took) in _refusals(proxy, url).items():
        if api == "messages":  # Anthropic's envelope
            assert body["type"] == "error", body
            error = body["error"]
            assert error["type"] == "invalid_request_error", body
        else:
            error = body
            assert error["code"] == "invalid_image", body
            assert error["param"] == ("input" if api == "responses" else "messages"), body
        assert words in error["message"] and host in error["message"], (api, error)
        assert took < within, (api, took)


def test_fetching_off_is_a_400_that_says_so(url_fleet, images):
    refused = _metric(url_fleet["off"], "kvroute_proxy_image_fetch_refusals_total")
    _assert_refused(url_fleet["off"], f"{images}/img/1.png", "fetching is disabled")
    # chat, Responses, Messages (count_tokens asks a backend, not the routing)
    assert _metric(url_fleet["off"], "kvroute_proxy_image_fetch_refusals_total") == refused + 3


def test_loopback_is_refused_unless_allowed(url_fleet, images):
    strict = url_fleet["strict"]
    _assert_refused(strict, f"{images}/img/1.png", "loopback, private")
    # By name too: localhost resolves to loopback, which the resolver drops.
    port = images.rsplit(":", 1)[1]
    _assert_refused(strict, f"http://localhost:{port}/img/1.png", "loopback, private",
                    host="localhost")


LIMITS = [
    ("/slow", f"took longer than {TIMEOUT:g}s"),
    ("/huge", f"over the limit of {MAX_BYTES} bytes"),
    ("/declared", f"over the limit of {MAX_BYTES} bytes"),
    ("/html", "Content-Type is 'text/html'"),
    ("/lie", "bytes are not image/png"),
    ("/loop", "more than 3 redirects"),
    ("/missing.png", "answered HTTP 404"),
]


@pytest.mark.parametrize("path,words", LIMITS, ids=[p for p, _ in LIMITS])
def test_each_limit_is_a_400_in_time_and_the_proxy_still_serves(url_fleet, images, path, words):
    proxy = url_fleet["fetching"]
    _assert_refused(proxy, images + path, words, within=TIMEOUT + 3)
    assert chat(proxy, conversation(f"{images}/img/33.png"), model="vlm", max_tokens=2).body


def test_images_inline_are_held_to_the_body_limit(url_fleet, images):
    proxy = url_fleet["fetching"]
    one = chat(proxy, conversation(f"{images}/big/34.png"), model="vlm", max_tokens=2)
    assert one.body["usage"]["prompt_tokens"] > 0
    with pytest.raises(openai.APIStatusError) as e:
        chat(proxy, conversation(f"{images}/big/34.png", f"{images}/big/35.png"), model="vlm",
             max_tokens=2)
    assert e.value.status_code == 413, e.value.body
    error = e.value.body
    assert error["code"] == "request_too_large" and "fetched images" in error["message"], error
    assert f"{MAX_BODY}" in error["message"]


def test_only_http_and_https_are_fetched(url_fleet):
    _assert_refused(url_fleet["fetching"], "ftp://127.0.0.1/a.png", "only http and https")


def test_a_backend_never_fetches(url_fleet, images):
    # Even the URL a fetching proxy would take: a backend is sent data: URLs only.
    with pytest.raises(openai.BadRequestError) as e:
        chat(url_fleet["backends"][0], conversation(f"{images}/img/1.png"), max_tokens=2)
    assert "only data: URLs" in e.value.body["message"]


# -- in process: the fetcher and the address policy ------------------------------------


def _body(url: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": [{"type": "text", "text": "Look."}, {
                             "type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]}


def _inline(settings: FetchSettings, body: dict) -> dict:
    async def run() -> dict:
        fetcher = ImageFetcher(settings)
        await fetcher.start()
        try:
            await fetcher.inline(body)
        finally:
            await fetcher.close()
        return body

    return asyncio.run(run())


def test_a_fetched_image_has_the_inline_images_prefix_keys(images):
    settings = FetchSettings(enabled=True, allow=("127.0.0.1",))
    salt = prefix.make_salt(SECRET)
    for seed, ext, fmt in ((40, "png", "PNG"), (41, "jpg", "JPEG")):
        fetched = _inline(settings, _body(f"{images}/img/{seed}.{ext}"))
        part = fetched["messages"][1]["content"][1]["image_url"]
        assert part == {"url": image_url(seed, fmt), "detail": "low"}  # detail kept
        assert (prefix.chat_chain(fetched, model="vlm", salt=salt)
                == prefix.chat_chain(_body(image_url(seed, fmt)), model="vlm", salt=salt))


def test_a_redirect_is_checked_at_each_hop(images):
    port = images.rsplit(":", 1)[1]
    # localhost is allowed by name; its redirect to the 127.0.0.1 literal is not.
    with pytest.raises(APIError) as e:
        _inline(FetchSettings(enabled=True, allow=("localhost",)),
                _body(f"http://localhost:{port}/to-literal"))
    assert "loopback" in e.value.message and "127.0.0.1" in e.value.message


@pytest.mark.parametrize("address,public", [
    ("93.184.216.34", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("fd12::1", False),
    ("fec0::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("::ffff:93.184.216.34", True),
    ("2002:7f00:1::", False), ("64:ff9b::a9fe:a9fe", False), ("::127.0.0.1", False),
])
def test_which_addresses_are_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


def test_the_allowlist_takes_hosts_and_networks():
    policy = Policy(["127.0.0.1/32", "10.0.0.0/8", "images.internal", "fd00::/8"])
    assert policy.permits("anything", "127.0.0.1")
    assert policy.permits("anything", "::ffff:127.0.0.1")  # the mapped form of an allowed one
    assert not policy.permits("anything", "127.0.0.2")
    assert policy.permits("anything", "10.9.8.7")
    assert policy.permits("anything", "fd00::5")
    assert not policy.permits("anything", "192.168.0.1")
    assert policy.permits("Images.Internal.", "192.168.0.1")  # a named host: any address
    assert policy.permits("anything", "93.184.216.34")
    assert not policy.permits("anything", "not-an-address")


def test_fetch_settings_from_the_file_the_environment_and_flags(tmp_path):
    path = tmp_path / "fetch.toml"
    path.write_text('[proxy]\nfetch_images = true\nfetch_images_allow = ["10.0.0.0/8"]\n'
                    'fetch_images_timeout = 3\n')
    serve = config.build({"config": str(path)}, {"KVROUTE_FETCH_IMAGES_MAX_BYTES": "1MiB"})
    assert (serve.fetch_images, serve.fetch_images_allow, serve.fetch_images_timeout,
            serve.fetch_images_max_bytes) == (True, ["10.0.0.0/8"], 3.0, 1 << 20)
    # The proxy `kvroute serve` starts reads the same from the variables it is given.
    proxy = config.resolve(config.PROXY, {}, config.fetch_variables(serve))
    assert (proxy["fetch_images"], proxy["fetch_images_allow"], proxy["fetch_images_timeout"],
            proxy["fetch_images_max_bytes"]) == (True, ["10.0.0.0/8"], 3.0, 1 << 20)
    defaults = config.resolve(config.PROXY, {}, {})
    assert defaults["fetch_images"] is False and defaults["fetch_images_allow"] == []
    assert config.resolve(config.PROXY, {}, {"KVROUTE_FETCH_IMAGES_ALLOW": "127.0.0.1,Img.Lan."}
                          )["fetch_images_allow"] == ["127.0.0.1/32", "img.lan"]
    for bad in ("http://x", "a b", "x/y", ".lan"):
        with pytest.raises(config.ConfigError):
            config.resolve(config.PROXY, {}, {"KVROUTE_FETCH_IMAGES_ALLOW": bad})


@pytest.mark.parametrize("url", [
    "http://2130706433/a.png", "http://127.1/a.png", "http://0x7f.0.0.1/a.png",
    "http://[::1]/a.png", "http://[::ffff:127.0.0.1]/a.png", "http://169.254.169.254/latest",
    "http://[fe80::1%25eth0]/a.png", "file:///etc/passwd", "gopher://127.0.0.1/a",
])
def test_odd_spellings_of_internal_addresses_are_never_connected_to(url):
    # Nothing listens on these: a connection attempt would say so; a refusal comes first.
    with pytest.raises(APIError) as e:
        _inline(FetchSettings(enabled=True), _body(url))
    assert e.value.status == 400 and e.value.code == "invalid_image"
    assert "could not be used" in e.value.message
    assert "no connection" not in e.value.message, e.value.message


def test_a_request_has_at_most_max_urls_fetched():
    from kvroute.proxy.image_fetch import MAX_URLS

    body = _body("http://127.0.0.1:9/0.png")
    body["messages"][1]["content"] += [{"type": "image_url", "image_url": {
        "url": f"http://127.0.0.1:9/{i}.png"}} for i in range(1, MAX_URLS + 1)]
    with pytest.raises(APIError) as e:
        _inline(FetchSettings(enabled=True, allow=("127.0.0.1",)), body)
    assert f"at most {MAX_URLS}" in e.value.message and e.value.code == "invalid_image"
