"""Prefix chains: equal prefixes share keys, any change changes every later key."""

import base64
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.prefix import (DEFAULT_BLOCK_BYTES, chain_segments, chat_chain, chat_segments,
                                 common_prefix, completion_segments, make_salt, request_chain)

SALT = make_salt("test-secret")
MODEL = "mlx-community/Qwen2.5-7B-Instruct-4bit"


def chain(body, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("salt", SALT)
    return chat_chain(body, **kw)


def chat_ends(body, **kw):
    return request_chain("chat", body, model=MODEL, salt=SALT, **kw)


def completion_keys(prompt, **kw):
    return [k for k, _ in request_chain("completion", {"prompt": prompt}, model=MODEL, salt=SALT,
                                        **kw)]


def conv(*contents, system="You are a helpful assistant."):
    msgs = [{"role": "system", "content": system}]
    for i, c in enumerate(contents):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": c})
    return {"messages": msgs}


def test_equal_bodies_equal_chains():
    a = chain(conv("hello " * 100, "hi there"))
    b = chain(conv("hello " * 100, "hi there"))
    assert a == b and len(a) > 3
    assert all(isinstance(k, int) and 0 <= k < 2**64 for k in a)


def test_ignores_fields_outside_the_prefix():
    base = conv("question")
    other = {**base, "temperature": 0.3, "stream": True, "max_tokens": 5}
    assert chain(base) == chain(other)


def test_diverges_exactly_at_first_differing_block():
    long_text = "".join(f"line {i:05d} of a long document\n" for i in range(200))
    a = conv(long_text)
    changed = long_text[:3000] + "X" + long_text[3001:]
    b = conv(changed)
    ca, cb = chain(a), chain(b)
    # Find the block that holds byte 3000 of the user message: walk the ends.
    ends = chat_ends(a)
    segs = chat_segments(a, model=MODEL, salt=SALT)
    user_seg_start = sum(len(s) for s in segs[:-1])
    # The content field starts after tag, role field, name field and its own length prefix.
    content_off = user_seg_start + 1 + (4 + len("user")) + 4 + 4
    changed_at = content_off + 3000
    first_diff = next(i for i, (_, end) in enumerate(ends) if end > changed_at)
    assert common_prefix(ca, cb) == first_diff
    assert len(ca) == len(cb)
    # Every key from the differing block on is different.
    assert all(x != y for x, y in zip(ca[first_diff:], cb[first_diff:]))


def test_message_boundaries_are_block_boundaries():
    turns = ["a" * 300, "b" * 10, "c" * 700, "d"]
    prev = chain(conv())
    for i in range(1, len(turns) + 1):
        cur = chain(conv(*turns[:i]))
        assert len(cur) > len(prev)
        assert cur[: len(prev)] == prev, "old chain must be a strict prefix of the new one"
        prev = cur


def test_block_sizes_and_offsets():
    body = conv("x" * 1000)
    pairs = chat_ends(body, block_bytes=64)
    segs = chat_segments(body, model=MODEL, salt=SALT)
    total = sum(len(s) for s in segs)
    ends = [e for _, e in pairs]
    assert ends == sorted(ends) and ends[-1] == total
    assert all(b - a <= 64 for a, b in zip([0] + ends, ends))
    # Each segment ends on a block end.
    seg_ends = [sum(len(s) for s in segs[: i + 1]) for i in range(len(segs))]
    assert set(seg_ends) <= set(ends)
    assert [k for k, _ in pairs] == chain(body, block_bytes=64)


def test_moving_bytes_between_fields_or_messages_changes_keys():
    a = {"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}
    b = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]}
    c = {"messages": [{"role": "user", "content": "abc"}]}
    d = {"messages": [{"role": "user", "name": "ab", "content": "c"}]}
    chains = [chain(x) for x in (a, b, c, d)]
    header = 1  # the header block is shared
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert common_prefix(chains[i], chains[j]) == header


def test_content_parts_concatenate_like_a_string():
    s = {"messages": [{"role": "user", "content": "hello world"}]}
    parts = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello "},
        {"type": "input_audio", "input_audio": {"data": "..."}},
        {"type": "text", "text": "world"},
    ]}]}
    assert chain(s) == chain(parts)


PNG = b"\x89PNG\r\n\x1a\n"


def _image(data: bytes) -> dict:
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG + data).decode()}}


def test_an_image_is_its_content_hash_where_it_stands():
    def body(*parts: dict | str) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]}

    a = chain(body("hello ", _image(b"a"), "world"))
    assert a == chain(body("hello ", _image(b"a"), "world"))
    assert a != chain(body("hello world"))  # an image is never dropped
    assert a != chain(body("hello ", _image(b"b"), "world"))
    assert a != chain(body("hello world", _image(b"a")))  # its place counts
    # A different data URL of the same bytes (its media-type parameters) is the same image.
    same = {"type": "image_url", "image_url": {
        "url": "data:image/png;charset=x;base64," + base64.b64encode(PNG + b"a").decode()}}
    assert a == chain(body("hello ", same, "world"))
    for bad in ("data:...", "https://example.com/a.png", 5):
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]"):
            chain(body({"type": "image_url", "image_url": {"url": bad}}))


TOOLS_A = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["c", "f"]}}}}}]
TOOLS_B = [{"function": {"parameters": {"properties": {"unit": {"enum": ["c", "f"]},
                                                       "city": {"type": "string"}}, "type": "object"},
                         "description": "Weather", "name": "get_weather"}, "type": "function"}]


def _tool_call_body(arguments):
    return {
        "tools": TOOLS_A,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        ],
    }


def test_tool_key_order_does_not_matter():
    assert chain({**conv("q"), "tools": TOOLS_A}) == chain({**conv("q"), "tools": TOOLS_B})
    assert chain({**conv("q"), "tools": TOOLS_A}) != chain(conv("q"))


def test_tool_call_argument_order_does_not_matter():
    as_dict_1 = chain(_tool_call_body({"city": "Paris", "unit": "c"}))
    as_dict_2 = chain(_tool_call_body({"unit": "c", "city": "Paris"}))
    as_str_1 = chain(_tool_call_body('{"city": "Paris", "unit": "c"}'))
    as_str_2 = chain(_tool_call_body('{"unit":"c","city":"Paris"}'))
    assert as_dict_1 == as_dict_2 == as_str_1 == as_str_2
    # Different arguments, or arguments that are not JSON, differ.
    assert chain(_tool_call_body({"city": "Lyon", "unit": "c"})) != as_dict_1
    not_json = chain(_tool_call_body("{city: Paris"))
    assert not_json != as_dict_1
    assert not_json == chain(_tool_call_body("{city: Paris"))


def test_salts_and_scopes_never_collide():
    body = conv("the same prompt " * 50, "the same answer")
    salts = [make_salt("s1"), make_salt("s2"), make_salt("s1", "tenant-a"),
             make_salt("s1", "tenant-b"), make_salt("s1", ""), make_salt(b"s1", "tenant-a")]
    assert salts[2] == salts[5]  # str and bytes secrets are the same secret
    distinct = salts[:5]
    assert len(set(distinct)) == len(distinct)
    chains = [set(chain(body, salt=s)) for s in distinct]
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert not chains[i] & chains[j]
    # Model ids are part of the header too.
    assert not set(chain(body)) & set(chain(body, model="other-model"))


def test_completion_chain():
    prompt = "Once upon a time " * 100
    a = completion_keys(prompt)
    b = completion_keys(prompt + "there was")
    assert a == completion_keys(prompt)
    assert 1 <= common_prefix(a, b) < len(a)
    # A completion and a chat request share only the header block (salt and model).
    assert common_prefix(a, chain({"messages": [{"role": "user", "content": prompt}]})) == 1
    pairs = request_chain("completion", {"prompt": prompt}, model=MODEL, salt=SALT, block_bytes=100)
    assert [e for _, e in pairs][-1] == sum(len(s) for s in completion_segments(
        prompt, model=MODEL, salt=SALT))


def test_completion_chain_of_token_ids():
    """Token ids are keyed as ids: the same ids give the same keys (a list of one list
    as the list, as the backend takes it), other ids or the same count of other ones
    other keys, and never the keys of a text; what is not a list of ids is refused."""
    ids = list(range(500, 900))
    a = completion_keys(ids)
    assert a == completion_keys([ids]) and len(a) > 1
    assert completion_keys(ids[:-1] + [1]) != a
    assert common_prefix(a, completion_keys("Once upon a time " * 100)) == 1  # the header
    for bad in ([], [True], [1, "2"], [-1], [1 << 32], [[1], [2]], [1.0]):
        with pytest.raises(ValueError):
            completion_keys(bad)


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1


@pytest.mark.parametrize(
    "body, msg",
    [
        ("not a dict", "request body"),
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [42]}, r"messages\[0\]"),
        ({"messages": [{"content": "no role"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "text"),
        ({"messages": [{"role": "user", "content": [7]}]}, r"content\[0\]"),
        ({"messages": [{"role": "user", "name": 1, "content": "x"}]}, "name"),
        ({"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}, "tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": ["x"]}]}, "tool_calls"),
        ({"messages": [{"role": "tool", "tool_call_id": 3, "content": "x"}]}, "tool_call_id"),
        ({"messages": [], "tools": {"a": 1}}, "tools"),
        ({"messages": [], "tools": [{"x": {1, 2}}]}, "tools"),
    ],
)
def test_bad_input_raises_value_error(body, msg):
    with pytest.raises(ValueError, match=msg):
        chain(body)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="model"):
        chat_chain(conv("x"), model="", salt=SALT)
    with pytest.raises(ValueError, match="salt"):
        chat_chain(conv("x"), model=MODEL, salt="not bytes")
    with pytest.raises(ValueError, match="block_bytes"):
        chat_chain(conv("x"), model=MODEL, salt=SALT, block_bytes=0)
    with pytest.raises(ValueError, match="prompt"):
        completion_keys(None)
    with pytest.raises(ValueError, match="scope"):
        make_salt("s", scope=3)


def test_lone_surrogates_do_not_crash():
    assert chain({"messages": [{"role": "user", "content": "a\ud800b"}]})


def test_128kb_request_chain_is_fast():
    body = {"messages": [{"role": "system", "content": "You are terse."}]
            + [{"role": "user" if i % 2 == 0 else "assistant",
                "content": f"turn {i}: " + "lorem ipsum dolor sit amet " * 150} for i in range(32)]}
    size = len(orjson.dumps(body))
    assert 120_000 < size < 140_000
    chain(body)  # warm up
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        keys = chain(body)
    ms = (time.perf_counter() - t0) / n * 1e3
    print(f"\n128 KB chat request ({size} bytes, {len(keys)} keys of {DEFAULT_BLOCK_BYTES} B): {ms:.3f} ms/chain")
    # A bound hundreds of times what it takes (under 1 ms on a 2-core machine): it
    # catches a change of complexity (a quadratic walk), not a slow moment. The speed
    # itself is measured by bench/bench_proxy.py, which chains every proxied request.
    assert ms < 200, ms


# -- properties ---------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=600)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text},
    optional={"name": st.text(max_size=10)},
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_message, max_size=8), st.integers(min_value=0, max_value=8),
       st.sampled_from([16, 64, 256]))
def test_prefix_of_messages_is_prefix_of_chain(messages, k, block):
    full = chain({"messages": messages}, block_bytes=block)
    head = chain({"messages": messages[:k]}, block_bytes=block)
    assert full[: len(head)] == head
    assert common_prefix(full, head) == len(head)


@settings(max_examples=60, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.data())
def test_any_change_changes_the_chain_from_there(messages, data):
    i = data.draw(st.integers(min_value=0, max_value=len(messages) - 1))
    changed = [dict(m) for m in messages]
    changed[i]["content"] = changed[i]["content"] + data.draw(st.text(min_size=1, max_size=5))
    a = chain({"messages": messages}, block_bytes=32)
    b = chain({"messages": changed}, block_bytes=32)
    n = common_prefix(a, b)
    # The shared head covers at most the messages before i (plus the header).
    assert n <= len(chain({"messages": messages[: i + 1]}, block_bytes=32)) - 1
    assert n >= len(chain({"messages": messages[:i]}, block_bytes=32))
    assert not set(a[n:]) & set(b[n:])


# -- request_chain: the one function both proxy and backend use -----------------------

from kvroute.core.prefix import PREFIX_SCHEME, fingerprint, request_kind  # noqa: E402


def test_request_chain_is_the_chat_and_completion_chain():
    body = conv("hello " * 80)
    assert request_chain("chat", body, model=MODEL, salt=SALT) == chain_segments(
        chat_segments(body, model=MODEL, salt=SALT), salt=SALT, block_bytes=DEFAULT_BLOCK_BYTES)
    assert request_chain("completion", {"prompt": "once"}, model=MODEL, salt=SALT) == \
        chain_segments(completion_segments("once", model=MODEL, salt=SALT), salt=SALT,
                       block_bytes=DEFAULT_BLOCK_BYTES)
    assert chat_chain(body, model=MODEL, salt=SALT) == [k for k, _ in chat_ends(body)]
    assert request_kind("/v1/chat/completions") == "chat"
    assert request_kind("/v1/completions") == "completion"


def test_one_element_prompt_list_is_its_string():
    # The backend accepts ["text"] as "text" (kvroute/backend/requests.py): the keys must agree.
    assert request_chain("completion", {"prompt": ["once upon"]}, model=MODEL, salt=SALT) == \
        request_chain("completion", {"prompt": "once upon"}, model=MODEL, salt=SALT)
    with pytest.raises(ValueError):  # two texts: the backend takes one prompt
        request_chain("completion", {"prompt": ["a", "b"]}, model=MODEL, salt=SALT)
    with pytest.raises(ValueError):
        request_chain("other", {"prompt": "x"}, model=MODEL, salt=SALT)


def test_tool_choice_none_hashes_no_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    plain = conv("what is the weather")
    with_tools = {**plain, "tools": tools}
    none = {**with_tools, "tool_choice": "none"}
    auto = {**with_tools, "tool_choice": "auto"}
    c = lambda b: request_chain("chat", b, model=MODEL, salt=SALT)  # noqa: E731
    # The template renders tool_choice "none" without the tools: so does the chain.
    assert c(none) == c(plain)
    assert c(auto) == c(with_tools) != c(plain)


def test_fingerprint_names_secret_and_block_size_without_the_secret():
    a = fingerprint("s1", 256)
    assert a == fingerprint("s1", 256)
    assert a["prefix_scheme"] == PREFIX_SCHEME == 4
    assert a["secret_tag"] != fingerprint("s2", 256)["secret_tag"]
    assert fingerprint("s1", 128)["block_bytes"] == 128
    assert "s1" not in a["secret_tag"] and len(a["secret_tag"]) == 16


# -- layouts: the segments in the order the chat template renders them ----------------

from kvroute.core.prefix import DEFAULT_LAYOUT, MARK, TOOLS, Layout, arrange, detect_layout  # noqa: E402

QWEN = Layout("after_system")
LLAMA = Layout("after_system", tools_mark=True)
MISTRAL = Layout("before_last_user", "last_user")


def test_arrange_puts_tools_and_system_prompt_where_templates_do():
    roles = ["system", "user", "assistant", "user"]
    assert arrange(roles, True) == [TOOLS, 0, 1, 2, 3]
    assert arrange(roles, True, QWEN) == [0, TOOLS, 1, 2, 3]
    assert arrange(["user"], True, QWEN) == [TOOLS, 0]  # no system prompt: tools first
    assert arrange(["developer", "user"], True, QWEN) == [0, TOOLS, 1]
    assert arrange(roles, True, LLAMA) == [MARK, 0, TOOLS, 1, 2, 3]
    assert arrange(roles, True, Layout("end")) == [0, 1, 2, 3, TOOLS]
    assert arrange(roles, True, Layout("none")) == arrange(roles, False) == [0, 1, 2, 3]
    # Mistral v3: [AVAILABLE_TOOLS], then "[INST] system\n\nuser" as the last turn...
    assert arrange(roles, True, MISTRAL) == [1, 2, TOOLS, 0, 3]
    assert arrange(roles, False, MISTRAL) == [1, 2, 0, 3]
    # ... and no system prompt at all when the last message is not a user message.
    assert arrange(["system", "user", "assistant"], True, MISTRAL) == [TOOLS, 1, 2]
    assert arrange(["system"], True, MISTRAL) == []  # no user turn: no tools either
    assert arrange([], True, QWEN) == [TOOLS]


def test_layout_is_a_closed_set():
    assert Layout() == DEFAULT_LAYOUT
    for bad in ({"tools_at": "middle"}, {"system_at": "last"}, {"tools_mark": "yes"}):
        with pytest.raises(ValueError):
            Layout(**bad)
    assert str(MISTRAL) == "tools before_last_user, system last_user"


def test_layout_orders_the_segments():
    body = {**conv("what is the weather"), "tools": TOOLS_A}
    segs = chat_segments(body, model=MODEL, salt=SALT)
    tools, system, user = segs[1], segs[2], segs[3]
    assert tools[:1] == b"T" and system[:1] == user[:1] == b"M"
    kw = {"model": MODEL, "salt": SALT}
    assert chat_segments(body, **kw, layout=QWEN) == [segs[0], system, tools, user]
    assert chat_segments(body, **kw, layout=Layout("none")) == [segs[0], system, user]
    assert chat_segments(body, **kw, layout=LLAMA) == [segs[0], b"t", system, tools, user]
    # tool_choice "none": the template sees no tools, so neither the list nor the mark.
    none = {**body, "tool_choice": "none"}
    assert chat_segments(none, **kw, layout=LLAMA) == [segs[0], system, user]
    assert request_chain("chat", body, **kw, layout=QWEN) == chain_segments(
        chat_segments(body, **kw, layout=QWEN), salt=kw["salt"], block_bytes=DEFAULT_BLOCK_BYTES)
    # Completions have no template: the layout changes nothing.
    assert request_chain("completion", {"prompt": "x"}, **kw, layout=QWEN) == \
        request_chain("completion", {"prompt": "x"}, **kw)


def test_shared_tools_are_no_shared_prefix_after_the_system_prompt():
    a = {**conv("hello", system="You are agent A."), "tools": TOOLS_A}
    b = {**conv("hello", system="You are agent B."), "tools": TOOLS_A}
    assert common_prefix(chain(a), chain(b)) > 1  # tools first: they look shared
    assert common_prefix(chain(a, layout=QWEN), chain(b, layout=QWEN)) == 1  # the header only


_tools = st.sampled_from([None, TOOLS_A])


@settings(max_examples=80, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.lists(_message, min_size=1, max_size=3),
       _tools,
       st.sampled_from([DEFAULT_LAYOUT, QWEN, LLAMA, Layout("none"), Layout("before_last_user")]))
def test_a_growing_conversation_keeps_its_chain_where_the_template_keeps_its_text(
        messages, more, tools, layout):
    # Tools at the start, after the system prompt or nowhere: appending messages never
    # changes what comes before them. Before the last user turn: as long as no user
    # message is appended.
    if layout.tools_at == "before_last_user" and tools:
        more = [m for m in more if m["role"] != "user"] or [{"role": "tool", "content": "x"}]
    head = {"messages": messages, "tools": tools}
    full = {"messages": messages + more, "tools": tools}
    a, b = chain(head, layout=layout, block_bytes=64), chain(full, layout=layout, block_bytes=64)
    assert b[: len(a)] == a and len(b) > len(a)


def test_detect_layout_falls_back_to_tools_first_and_says_why():
    def tools_after_first_user(messages, tools):
        out = [f"<{m['role']}>{m['content']}" for m in messages]
        if tools:
            i = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
            out.insert(i + 1, orjson.dumps(tools).decode())
        return "".join(out)

    layout, why = detect_layout(tools_after_first_user)
    assert layout == DEFAULT_LAYOUT and "no known layout" in why

    def refuses(messages, tools):
        raise ValueError("no")

    assert detect_layout(refuses) == (DEFAULT_LAYOUT, "the template rendered none of the probe "
                                                      "conversations")

    def tools_first(messages, tools):
        head = "tools:" + orjson.dumps(tools).decode() if tools else ""
        return head + "".join(f"<{m['role']}>{m['content']}" for m in messages)

    assert detect_layout(tools_first) == (DEFAULT_LAYOUT, "")

    def tools_last(messages, tools):
        tail = "tools:" + orjson.dumps(tools).decode() if tools else ""
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + tail

    assert detect_layout(tools_last) == (Layout("end"), "")
