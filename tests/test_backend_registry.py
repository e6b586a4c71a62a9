"""A real backend process advertising its prompt cache in a real Redis.

Each test starts (or shares) a `redis-server` child and real backend processes
running the demo model, sends real HTTP requests, and reads Redis exactly as a
proxy would: `Registry.lookup` over `prefix.chat_chain` of a request body salted
with the deployment secret. DESIGN.md invariants 3-5 (docs/DESIGN.md): Redis holds hashes, never
prompt text; Redis is an accelerator, not a dependency of correctness; a dead
backend is forgotten fast and a restarted one inherits nothing.

Every wait is a poll with a deadline (harness.wait_until), never a sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid

import pytest
import redis as redis_sync
from tests.harness import BackendProcess, chat, wait_until

from kvroute.devtools.demo_model import DEMO_REPLY
from kvroute.core.prefix import chat_chain, common_prefix, make_salt
from kvroute.serve.redis_server import RedisServer
from kvroute.core.registry import PrefixMatch, Registry

MODEL_ID = "demo"
SECRET = "kvr-test-secret-0c4e7d"
SALT = make_salt(SECRET)
# The backend heartbeats every second with the registry's default record TTL.
RECORD_TTL = 3.0
# A proxy's lookup deadline (Registry's default); tests that only want an answer
# use a generous one so a slow CI box never reads as "Redis down".
PROXY_LOOKUP_TIMEOUT = inspect.signature(Registry).parameters["lookup_timeout"].default
PATIENT_LOOKUP_TIMEOUT = 2.0


# ---------------------------------------------------------------------------
# Helpers


def chain(messages: list[dict], salt: bytes = SALT) -> list[int]:
    """The prefix keys a proxy computes for a chat request with these messages."""
    return chat_chain({"model": MODEL_ID, "messages": messages}, model=MODEL_ID, salt=salt)


async def _lookup(url: str, keys: list[int], lookup_timeout: float) -> dict[str, PrefixMatch] | None:
    # One Registry per event loop (asyncio.run makes a fresh loop each call).
    reg = Registry(url, lookup_timeout=lookup_timeout, record_ttl=RECORD_TTL)
    try:
        return await reg.lookup(MODEL_ID, keys)
    finally:
        await reg.close()


def lookup(url: str, messages: list[dict], lookup_timeout: float = PATIENT_LOOKUP_TIMEOUT):
    return asyncio.run(_lookup(url, chain(messages), lookup_timeout))


def timed_lookup(url: str, messages: list[dict], lookup_timeout: float):
    """(result, seconds spent inside Registry.lookup itself)."""

    async def go():
        reg = Registry(url, lookup_timeout=lookup_timeout, record_ttl=RECORD_TTL)
        try:
            t0 = time.monotonic()
            result = await reg.lookup(MODEL_ID, chain(messages))
            return result, time.monotonic() - t0
        finally:
            await reg.close()

    return asyncio.run(go())


def live_backend_ids(url: str) -> list[str]:
    async def go():
        reg = Registry(url, record_ttl=RECORD_TTL)
        try:
            return [r.backend_id for r in await reg.live_backends()]
        finally:
            await reg.close()

    return asyncio.run(go())


def depth(url: str, messages: list[dict], backend_id: str) -> int | None:
    """The backend's advertised depth on this conversation; None if not listed
    (or Redis did not answer)."""
    found = lookup(url, messages)
    if found is None or backend_id not in found:
        return None
    return found[backend_id].depth


def wait_depth(url: str, messages: list[dict], backend_id: str, expected: int,
               timeout: float = 5.0, what: str = "") -> None:
    last = {}

    def check():
        last["depth"] = depth(url, messages, backend_id)
        return last["depth"] == expected

    try:
        wait_until(check, timeout, interval=0.05, what=what or f"depth {expected}")
    except TimeoutError:
        pytest.fail(f"{what or 'lookup'}: {backend_id} depth stayed {last.get('depth')!r}, "
                    f"expected {expected} within {timeout}s")


def conversation(topic: str = "") -> list[dict]:
    # A nonce keeps each conversation apart from every other one in the store.
    return [
        {"role": "system", "content": f"{uuid.uuid4().hex[:12]}: you are terse. {topic}"},
        {"role": "user", "content": "Say hello to the team."},
    ]


def answered(backend: BackendProcess, messages: list[dict], timeout: float = 30.0) -> dict:
    """One whole chat completion, the demo model's known reply; the assistant message as
    sent (what the next turn carries)."""
    reply = chat(backend, messages, timeout=timeout)
    assert reply.body["choices"][0]["finish_reason"] == "stop", reply.body
    assert reply.text == DEMO_REPLY, reply.body
    return reply.message


def advertised(messages: list[dict], reply: dict) -> list[dict]:
    """What the backend advertises after a normal finish: the prompt plus the
    assistant turn as the client will send it back."""
    return messages + [reply]


def extended(messages: list[dict], reply: dict) -> list[dict]:
    return messages + [reply, {"role": "user", "content": "And now say goodbye."}]


def start_backend(model, log_dir, redis_url: str, backend_id: str, *extra: str,
                  port: int | None = None) -> BackendProcess:
    proc = BackendProcess(model, model_id=MODEL_ID, log_dir=log_dir, backend_id=backend_id, port=port,
                          extra=["--redis-url", redis_url, "--secret", SECRET, *extra])
    proc.start()
    return proc


def wait_listed(url: str, backend_id: str, timeout: float = 5.0) -> PrefixMatch:
    """Poll until the backend's first heartbeat made it visible to lookups."""
    probe = conversation()
    return wait_until(lambda: (lookup(url, probe) or {}).get(backend_id), timeout, interval=0.05,
                      what=f"{backend_id} listed in lookup")


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def shared_redis():
    """This module's own redis-server: its tests pause, stop and restart it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def shared_backend(text_model, tmp_path_factory, shared_redis):
    """One backend for the tests that neither kill it nor need a special budget.
    Tests that stop Redis restart it on the same port before they end."""
    proc = start_backend(text_model, tmp_path_factory.mktemp("registry-backend-logs"),
                         shared_redis.url, "shared-b1")
    yield proc
    proc.stop()


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path


# ---------------------------------------------------------------------------
# 1. What a proxy reads after a request


def test_follow_up_turn_is_advertised_at_full_depth(shared_backend, shared_redis):
    url, bid = shared_redis.url, shared_backend.backend_id
    first = conversation("first")
    reply = answered(shared_backend, first)
    nxt = extended(first, reply)

    # The next turn shares every key of prompt + assistant turn (a message boundary
    # is a block boundary), and nothing after it.
    expected = common_prefix(chain(nxt), chain(advertised(first, reply)))
    assert expected == len(chain(advertised(first, reply))) > len(chain(first))
    wait_depth(url, nxt, bid, expected, what="follow-up turn advertised")

    found = lookup(url, nxt)
    assert found[bid].record.url == shared_backend.url
    assert found[bid].record.models == [MODEL_ID]
    assert found[bid].marked_depth >= found[bid].depth

    # An unrelated conversation matches nothing but the header block (salt and model
    # id), which every chain of this model starts with; the backend is still listed
    # so a proxy can choose it by load.
    other = conversation("unrelated")
    found = lookup(url, other)
    assert bid in found
    shared = common_prefix(chain(other), chain(advertised(first, reply)))
    assert shared == 1
    assert found[bid].depth == shared
    assert found[bid].depth < len(chain(other[:1])), "no message block of an unrelated prompt may match"


# ---------------------------------------------------------------------------
# 2. Eviction withdraws keys


def test_eviction_withdraws_the_evicted_conversation(text_model, log_dir, redis_db):
    url = redis_db.url
    # Room for one finished demo-model conversation (~80 KB of KV), not two.
    b = start_backend(text_model, log_dir, url, "evict-b1", "--cache-bytes", "120KB")
    try:
        convs = [conversation(f"evict {i}") for i in range(3)]
        first_reply = answered(b, convs[0])
        first_adv = advertised(convs[0], first_reply)
        wait_depth(url, extended(convs[0], first_reply), b.backend_id, len(chain(first_adv)),
                   what="first conversation advertised")
        first_ids = {e["id"] for e in b.cache()}
        assert first_ids, "the first conversation was not cached (budget below one entry?)"

        later = [advertised(c, answered(b, c)) for c in convs[1:]]

        # Precondition: the budget really evicted the first conversation's entries.
        # (The paged store cuts an entry back from its tail, block by block: what may be
        # left of the first conversation is its first block, which holds none of its
        # own messages' keys.)
        entries = b.cache()
        kept = [e for e in entries if e["id"] in first_ids]
        assert all(not e["chain"] and e["tokens"] <= 32 for e in kept), (
            f"budget too large for this test: first entries {first_ids} still in {entries}")
        assert b.health()["cache"]["evictions"] >= 1

        # What a proxy now sees for the first conversation: only what the entries
        # still held share with it (the header block), never its own messages.
        remaining = max(common_prefix(chain(first_adv), chain(m)) for m in later)
        assert remaining < len(chain(convs[0][:1]))
        wait_depth(url, extended(convs[0], first_reply), b.backend_id, remaining,
                   what="evicted conversation withdrawn")
        # The newest conversation is still advertised in full.
        last = later[-1]
        assert depth(url, last, b.backend_id) == len(chain(last))
    finally:
        b.stop()


# ---------------------------------------------------------------------------
# 3. A killed backend is forgotten; its successor inherits nothing


def test_killed_backend_is_forgotten_and_restart_inherits_nothing(text_model, log_dir, redis_db):
    url = redis_db.url
    old = start_backend(text_model, log_dir, url, "crashy-b1")
    try:
        msgs = conversation("crash")
        reply = answered(old, msgs)
        nxt = extended(msgs, reply)
        full = len(chain(advertised(msgs, reply)))
        wait_depth(url, nxt, old.backend_id, full, what="advertised before the crash")
        old_instance = lookup(url, nxt)[old.backend_id].record.instance_id

        old.proc.kill()
        old.proc.wait(10)
        killed_at = time.monotonic()
        wait_until(lambda: (found := lookup(url, nxt)) is not None and old.backend_id not in found,
                   timeout=2 * RECORD_TTL, interval=0.05, what="killed backend dropped from lookup")
        forgotten_after = time.monotonic() - killed_at
        # The last record was written at most one heartbeat before the kill.
        assert forgotten_after <= RECORD_TTL + 0.5, forgotten_after
        assert old.backend_id not in live_backend_ids(url)
    finally:
        old.stop()

    # Same id, same port, new process (new instance id), no request yet.
    new = start_backend(text_model, log_dir, url, "crashy-b1", port=old.port)
    try:
        seen = {}

        def listed_with_depth_zero():
            found = lookup(url, nxt)
            if found is None or new.backend_id not in found:
                return False
            seen["match"] = m = found[new.backend_id]
            assert m.record.instance_id != old_instance, "lookup returned the dead instance's record"
            assert m.depth == 0, f"restarted backend inherited depth {m.depth} of its predecessor"
            assert m.marked_depth == 0
            return True

        wait_until(listed_with_depth_zero, timeout=5.0, interval=0.05,
                   what="restarted backend's first heartbeat")
        assert new.backend_id in live_backend_ids(url)
    finally:
        new.stop()


# ---------------------------------------------------------------------------
# 4. Redis restarted empty: the backend re-publishes by itself


def test_advertisements_reappear_after_redis_restarts_empty(shared_backend, shared_redis):
    url, bid = shared_redis.url, shared_backend.backend_id
    msgs = conversation("redis restart")
    reply = answered(shared_backend, msgs)
    nxt = extended(msgs, reply)
    full = len(chain(advertised(msgs, reply)))
    wait_depth(url, nxt, bid, full, what="advertised before the Redis restart")

    client = redis_sync.Redis.from_url(url)
    client.set("kvroute-test:marker", "1")
    client.close()
    shared_redis.restart()
    client = redis_sync.Redis.from_url(url)
    try:
        assert client.exists("kvroute-test:marker") == 0, "Redis did not come back empty"
    finally:
        client.close()

    # No new request: the publisher notices its record is gone and re-advertises.
    wait_depth(url, nxt, bid, full, timeout=10.0, what="re-advertised after the Redis restart")


# ---------------------------------------------------------------------------
# 5. Redis down: the backend serves; lookups answer "unknown" within their deadline


def test_backend_serves_while_redis_is_down_and_republishes_after(shared_backend, shared_redis):
    url, bid = shared_redis.url, shared_backend.backend_id
    wait_listed(url, bid)
    try:
        # A hung Redis (SIGSTOP): connections open, nothing answers.
        shared_redis.pause()
        result, elapsed = timed_lookup(url, conversation(), PROXY_LOOKUP_TIMEOUT)
        assert result is None
        # Its deadline (50 ms) bounded it, with a margin for a loaded machine; without
        # one it would wait on the hung socket.
        assert elapsed < PROXY_LOOKUP_TIMEOUT + 0.5, elapsed
        hung_msgs = conversation("while redis hangs")
        hung_reply = answered(shared_backend, hung_msgs, timeout=15)

        # A dead Redis: connections refused.
        shared_redis.stop()
        result, elapsed = timed_lookup(url, conversation(), PROXY_LOOKUP_TIMEOUT)
        assert result is None
        assert elapsed < PROXY_LOOKUP_TIMEOUT + 0.5, elapsed
        down_msgs = conversation("while redis is down")
        down_reply = answered(shared_backend, down_msgs, timeout=15)
        assert shared_backend.alive()
    finally:
        shared_redis.resume()
        if shared_redis.proc is None:
            shared_redis.start()  # same port: the backend's --redis-url still points here

    # Back up (empty): both conversations served while Redis was away get advertised.
    for msgs, reply in [(hung_msgs, hung_reply), (down_msgs, down_reply)]:
        wait_depth(url, extended(msgs, reply), bid, len(chain(advertised(msgs, reply))),
                   timeout=10.0, what="advertised after Redis came back")


# ---------------------------------------------------------------------------
# 6. Redis holds hashes and ids, never prompt text (nor the secret or salt)


def _dump(client: redis_sync.Redis) -> list[tuple[bytes, str, list[bytes]]]:
    out = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key) or b""]
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = list(client.zrange(key, 0, -1))
        elif kind == "hash":
            values = [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == "list":
            values = list(client.lrange(key, 0, -1))
        elif kind == "none":  # expired between SCAN and TYPE
            continue
        else:
            raise AssertionError(f"unexpected Redis type {kind} for {key!r}")
        out.append((key, kind, values))
    return out


def test_redis_holds_no_prompt_text(shared_backend, shared_redis):
    url, bid = shared_redis.url, shared_backend.backend_id
    phrase = "quokka-zeppelin-" + uuid.uuid4().hex[:10]
    msgs = [
        {"role": "system", "content": f"You are {phrase}, a careful assistant. " * 12},
        {"role": "user", "content": f"Tell the team about {phrase} please."},
    ]
    reply = answered(shared_backend, msgs)
    wait_depth(url, extended(msgs, reply), bid, len(chain(advertised(msgs, reply))),
               what="phrase conversation advertised")

    client = redis_sync.Redis.from_url(url)
    try:
        dump = _dump(client)
    finally:
        client.close()
    assert dump, "Redis is empty: nothing was checked"
    forbidden = {
        "phrase": phrase.encode(),
        "user text": b"Tell the team about",
        "assistant reply": DEMO_REPLY.encode(),
        "secret": SECRET.encode(),
        "salt": SALT,
        "salt (hex)": SALT.hex().encode(),
    }
    for key, kind, values in dump:
        for blob in [key, *values]:
            for name, needle in forbidden.items():
                assert needle not in blob, f"{name} found in Redis {kind} {key!r}"

    # Salting: the advertised keys exist under the secret's salt, and someone who
    # knows the prompt but not the secret cannot find them (e.g. with the default salt).
    key_names = {key for key, _, _ in dump}

    def present(keys: list[int]) -> int:
        return sum(any(f"{k:016x}".encode() in name for name in key_names) for k in keys)

    salted = chain(advertised(msgs, reply))
    assert present(salted) == len(salted)
    for guess in (make_salt(""), make_salt("kvroute")):
        assert present(chain(advertised(msgs, reply), salt=guess)) == 0


# ---------------------------------------------------------------------------
# 7. Clean shutdown withdraws at once


def test_clean_shutdown_withdraws_immediately(text_model, log_dir, redis_db):
    url = redis_db.url
    b = start_backend(text_model, log_dir, url, "graceful-b1")
    try:
        msgs = conversation("shutdown")
        reply = answered(b, msgs)
        nxt = extended(msgs, reply)
        wait_depth(url, nxt, b.backend_id, len(chain(advertised(msgs, reply))),
                   what="advertised before shutdown")
        assert b.backend_id in live_backend_ids(url)
    finally:
        b.stop()  # SIGTERM, waits for the process to exit
    assert b.proc.returncode == 0, b.log()

    # No polling: the record was deleted before the process exited, not left to its TTL.
    found = lookup(url, nxt)
    assert found is not None
    assert b.backend_id not in found
    assert b.backend_id not in live_backend_ids(url)
