"""Images in, cached: a vision-language model behind the same endpoint and cache.

Real backend processes serve the tiny random-weight Gemma 3 VLM built locally
(kvroute/devtools/vision_models.py) over real HTTP, with the official `openai`
client; the proxy test runs two of them behind a real proxy and Redis. The tiny
model's text layers have 32-token sliding windows, so its caches cannot be trimmed
and hits come from the checkpoints the engine keeps, as in tests/test_families.py.
"Cold" is the same request in a fresh cache scope, which no entry can serve.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from tests import harness
from tests.harness import (TOOLS, BackendProcess, ProxyProcess, SSEStream, chat, get_json,
                           post_json, wait_until)
from tests.test_families import (GREEDY, assert_entries_consistent,
                                 assert_kept_after_disconnect_mid_decode, assert_prompt_kept,
                                 assert_same_answer, cached, cold, follow_up, idle, no_eos,
                                 prompt_tokens)

from kvroute.core import prefix
from kvroute.devtools import vision_models
from kvroute.devtools.demo_model import DEMO_TOOL_REPLY

SYSTEM = ("You describe pictures for a team's incident reports: say what the screenshot "
          "shows, name any error message, and keep it to two short sentences. ") * 2
SECRET = "vision-secret"


def image_url(seed: int, fmt: str = "PNG", size: int = 64, height: int | None = None) -> str:
    """A data URL of a random-noise image (each seed its own picture)."""
    shape = (height or size, size, 3)
    pixels = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    kind = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(out.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def conversation(*images: str, question: str = "What does this screenshot show?") -> list[dict]:
    return [{"role": "system", "content": f"{uuid.uuid4().hex[:8]} {SYSTEM}"},
            {"role": "user", "content": [{"type": "text", "text": question},
                                         *(image_part(u) for u in images)]}]


# What each family's text calls an image token (a client may type it).
IMAGE_TOKENS = {"gemma3": vision_models.IMAGE_TOKEN, "mistral3": vision_models.PIXTRAL_TOKENS[0]}


@pytest.fixture(scope="module", params=vision_models.FAMILIES)
def vlm_model(request, model_cache):
    return vision_models.ensure(request.param, cache_dir=model_cache)


@pytest.fixture(scope="module")
def vlm(vlm_model, tmp_path_factory) -> BackendProcess:
    proc = BackendProcess(vlm_model, model_id="vlm", log_dir=tmp_path_factory.mktemp("vlm-logs"),
                          extra=["--prefill-step", "32", "--enable-faults"])
    proc.start()
    yield proc
    proc.stop()


def vlm_family(backend: BackendProcess) -> str:
    return backend.model.rstrip("/").split("vision-model-")[1].split("-v")[0]


def encoded(backend: BackendProcess) -> int:
    return backend.health()["vision"]["encoded"]


def test_image_turn2_hits_exactly_and_skips_the_encoder(vlm):
    messages = conversation(image_url(1))
    first = chat(vlm, messages, **GREEDY).body
    tokens = prompt_tokens(first)
    assert tokens > vision_models.TOKENS_PER_IMAGE + 100

    before = encoded(vlm)
    repeat = chat(vlm, messages, **GREEDY).body
    assert cached(repeat) == tokens - 1
    assert_same_answer(repeat, first)
    assert encoded(vlm) == before  # the hit covered the image: no encoder run

    turn2 = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "Which error is it?"}]
    second = chat(vlm, turn2, **GREEDY).body
    assert cached(second) >= tokens - 1, second["usage"]
    assert_same_answer(second, cold(vlm, turn2, **GREEDY))


def test_changed_image_is_not_a_hit(vlm):
    messages = conversation(image_url(2))
    # End-of-sequence banned: an answer needs a first token to compare log-probabilities.
    greedy = {**GREEDY, "logit_bias": no_eos(vlm)}
    first = chat(vlm, messages, **greedy).body
    other = [messages[0], {**messages[1], "content": [messages[1]["content"][0],
                                                      image_part(image_url(3))]}]
    answer = chat(vlm, other, **greedy).body
    # At most the text before the image is shared: the rest is prefilled, image included.
    assert cached(answer) <= prompt_tokens(first) - vision_models.TOKENS_PER_IMAGE - 1
    assert_same_answer(answer, cold(vlm, other, **greedy))
    # The image reaches the model: another image, other log-probabilities.
    logprob = [a["choices"][0]["logprobs"]["content"][0]["logprob"] for a in (first, answer)]
    assert abs(logprob[0] - logprob[1]) > 1e-5, logprob


def test_four_images_and_a_jpeg_hit_exactly(vlm):
    urls = [image_url(10), image_url(11, "JPEG"), image_url(12), image_url(13, "JPEG", 97)]
    urls.append(image_url(14, "PNG", 64, 40))  # not square: Pixtral gives it fewer tokens
    messages = conversation(*urls, question="Compare these four screenshots.")
    first = chat(vlm, messages, **GREEDY).body
    assert prompt_tokens(first) > 4 * vision_models.TOKENS_PER_IMAGE + 4
    repeat = chat(vlm, messages, **GREEDY).body
    assert cached(repeat) == prompt_tokens(first) - 1
    assert_same_answer(repeat, first)
    # The same images in another order are another prompt.
    swapped = conversation(*urls[::-1], question="Compare these four screenshots.")
    swapped[0] = messages[0]
    answer = chat(vlm, swapped, **GREEDY).body
    assert_same_answer(answer, cold(vlm, swapped, **GREEDY))
    assert cached(answer) < prompt_tokens(first) - 4 * vision_models.TOKENS_PER_IMAGE


def test_streamed_image_answer_and_penalties(vlm):
    messages = conversation(image_url(4))
    params = {"max_tokens": 5, "temperature": 0, "presence_penalty": 1.0,
              "frequency_penalty": 0.5, "logit_bias": no_eos(vlm)}  # a reply that is not empty
    whole = chat(vlm, messages, **params).text
    streamed = chat(vlm, messages, **params, stream=True).text
    assert streamed == whole and whole


BAD_IMAGES = [
    ("https://example.com/cat.png", "only data: URLs"),
    ("data:image/png;base64,!!!notbase64", "base64"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "image/gif"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"junk" * 10).decode(),
     "could not be decoded"),
    ("data:image/jpeg;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode(), "not image/jpeg"),
    ("data:image/png,rawbytes", "base64"),
]


@pytest.mark.parametrize("url,message", BAD_IMAGES, ids=[m for _, m in BAD_IMAGES])
def test_bad_image_is_a_400(vlm, url, message):
    with pytest.raises(openai.BadRequestError) as e:
        chat(vlm, conversation(url), max_tokens=2)
    error = e.value.body
    assert message in error["message"] and error["param"] == "messages", error
    assert chat(vlm, conversation(image_url(5)), max_tokens=2).text is not None  # still serving


def test_typed_image_token_is_a_400(vlm):
    from kvroute.backend.image_prompt import sentinel

    family = vlm_family(vlm)
    for text, images in (("look: " + IMAGE_TOKENS[family] * 3, [image_url(6)]),
                         ("look: " + sentinel(1), [image_url(6)]),
                         ("look: " + sentinel(0), [])):
        with pytest.raises(openai.BadRequestError) as e:
            chat(vlm, conversation(*images, question=text), max_tokens=2)
        assert e.value.body["code"] == "invalid_image"


def test_replies_never_hold_the_image_token(vlm):
    # A reply that held it would come back in the next turn's text as one image token
    # too many, and every later turn of that conversation would be refused.
    config = json.loads((Path(vlm.model) / "config.json").read_text())
    pushed = {str(config["image_token_index"]): 100}
    messages = conversation(image_url(7))
    first = chat(vlm, messages, max_tokens=3, logit_bias=pushed).body
    text = first["choices"][0]["message"]["content"]
    family = vlm_family(vlm)
    assert IMAGE_TOKENS[family] not in text, text
    assert_prompt_kept(vlm, first, follow_up(vlm, messages, text))


def test_text_model_refuses_images(backend):
    with pytest.raises(openai.BadRequestError) as e:
        chat(backend, conversation(image_url(1)), max_tokens=2)
    error = e.value.body
    assert error["code"] == "images_unsupported" and "does not take images" in error["message"]
    assert error["param"] == "messages"


def test_prefix_keys_name_images_by_content():
    salt = prefix.make_salt(SECRET)

    def chain(*urls: str) -> list[int]:
        messages = conversation(*urls)
        messages[0]["content"] = SYSTEM
        return prefix.chat_chain({"messages": messages}, model="vlm", salt=salt)

    a, b = image_url(1), image_url(2)
    assert chain(a) == chain(a)
    same_head = prefix.common_prefix(chain(a), chain(b))
    assert 0 < same_head < len(chain(a))  # the system prompt is shared, the image is not
    assert chain(a) != chain()  # an image is part of the prefix, not dropped
    with pytest.raises(ValueError, match="only data: URLs"):
        chain("http://example.com/x.png")


@pytest.fixture(scope="module")
def vlm_fleet(vlm_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("vlm-fleet-logs")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--secret", SECRET, "--prefill-step", "32"]
        return [BackendProcess(vlm_model, "vlm", logs, backend_id=f"vlm-{i}", extra=common)
                for i in range(2)]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f


def test_image_conversation_through_the_proxy(vlm_fleet):
    proxy = vlm_fleet["proxies"][0]
    messages = conversation(image_url(20))
    first = chat(proxy, messages, model="vlm", max_tokens=8, temperature=0)
    messages += [first.message, {"role": "user", "content": "And what is the error message?"}]
    second = chat(proxy, messages, model="vlm", max_tokens=8, temperature=0)
    assert second.headers["x-kvroute-backend"] == first.headers["x-kvroute-backend"]
    usage = second.body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * usage["prompt_tokens"], usage

    models = {m["id"]: m for m in get_json(proxy.url + "/v1/models")["data"]}
    assert models["vlm"]["input_modalities"] == ["text", "image"]


def messages_two_turns_cached(proxy: ProxyProcess, source: dict, again: dict | None = None) -> None:
    """Two turns about one image through the proxy's Messages API (the official
    client), under a system prompt of their own: turn 1 counts as `count_tokens` says,
    and turn 2 (its image as `again`, else `source` again) lands on turn 1's backend
    with at least 80% of its prompt read from the cache."""
    import anthropic

    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    system = f"{uuid.uuid4().hex[:8]} {SYSTEM}"
    question = {"type": "text", "text": "What does this screenshot show?"}
    turn1 = [{"role": "user", "content": [question, {"type": "image", "source": source}]}]
    first = claude.messages.with_raw_response.create(
        model="vlm", system=system, messages=turn1, max_tokens=8)
    reply = first.parse()
    counted = claude.messages.count_tokens(model="vlm", system=system, messages=turn1)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    image = [{"role": "user", "content": [question, {"type": "image", "source": again or source}]}]
    # A random model's reply can be empty (end-of-sequence first), which the API refuses
    # as an assistant turn; the hit does not depend on the reply's text.
    said = reply.content or [{"type": "text", "text": "ok"}]
    turn2 = image + [{"role": "assistant", "content": said},
                     {"role": "user", "content": "And the error message?"}]
    second = claude.messages.with_raw_response.create(
        model="vlm", system=system, messages=turn2, max_tokens=8)
    assert second.headers["x-kvroute-backend"] == first.headers["x-kvroute-backend"]
    usage = second.parse().usage
    total = usage.input_tokens + usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens >= 0.8 * total, usage


def test_anthropic_image_blocks_through_the_proxy(vlm_fleet):
    import anthropic

    proxy = vlm_fleet["proxies"][0]
    data = image_url(21).split(",", 1)[1]
    messages_two_turns_cached(proxy, {"type": "base64", "media_type": "image/png", "data": data})

    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="vlm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    # This proxy does not fetch (tests/test_image_urls.py has one that does).
    assert "fetching is disabled" in str(e.value) and "example.com" in str(e.value)


def responses_two_turns(proxy: ProxyProcess, url: str) -> tuple[Any, Any]:
    """Two turns of a conversation about the image at `url` through the proxy's
    Responses API (the official client), under a system prompt of its own."""
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    system = f"{uuid.uuid4().hex[:8]} {SYSTEM}"
    turn1 = [{"role": "user", "content": [
        {"type": "input_text", "text": "What does this screenshot show?"},
        {"type": "input_image", "image_url": url}]}]
    first = oai.responses.create(model="vlm", instructions=system, input=turn1,
                                 max_output_tokens=8, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "And the error message?"}]
    second = oai.responses.create(model="vlm", instructions=system, input=turn2,
                                  max_output_tokens=8, temperature=0)
    return first, second


def test_responses_input_image_through_the_proxy(vlm_fleet):
    first, second = responses_two_turns(vlm_fleet["proxies"][0], image_url(22))
    assert first.store is False  # a conversation with images never goes to Redis
    usage = second.usage
    assert usage.input_tokens_details.cached_tokens >= 0.8 * usage.input_tokens, usage


def test_readme_example_runs(vlm):
    """The README's image example, as written, against a backend of the tiny VLM."""
    import re
    import subprocess
    import sys

    from tests.harness import ROOT

    section = (ROOT / "README.md").read_text().split("## Images (vision-language models)")[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("http://127.0.0.1:8000", vlm.url).replace('"tiny-vlm"', '"vlm"')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    found = re.match(r"turn 2: (\d+) of (\d+) prompt tokens cached; turn 1's prompt, image "
                     r"included, was (\d+)", out.stdout)
    assert found, out.stdout
    cached_, total, turn1 = map(int, found.groups())
    # At least turn 1's prompt, image included (a random model's reply may not
    # tokenize back as it was generated: its part of the entry can miss).
    assert turn1 - 1 <= cached_ < total


# -- every exit path keeps an image prompt cached (as tests/test_families.py for text) --


def test_image_exit_eos_stop_and_max_tokens(vlm):
    for kw, reply in (({"kvroute_fault": "force:All clear."}, "All clear."),
                      ({"stop": ["STOP"], "kvroute_fault": "force:ship it STOP and wait"},
                       "ship it "),
                      ({"max_tokens": 3}, None)):
        messages = conversation(image_url(30))
        first = chat(vlm, messages, **kw).body
        text = first["choices"][0]["message"]["content"]
        assert reply is None or text == reply
        assert_prompt_kept(vlm, first, follow_up(vlm, messages, text))


def test_image_exit_tool_call_only(vlm):
    messages = conversation(image_url(31), question="What is the weather in Paris?")
    first = chat(vlm, messages, tools=TOOLS, kvroute_fault=f"force:{DEMO_TOOL_REPLY}").body
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    turn2 = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    assert_prompt_kept(vlm, first, chat(vlm, turn2, tools=TOOLS, max_tokens=2).body)


def test_image_exit_disconnect_mid_decode_and_errors(vlm):
    assert_kept_after_disconnect_mid_decode(vlm, conversation(image_url(32)))

    for step in (0, 2):  # the step completing the prompt, and one in decode
        messages = conversation(image_url(33 + step))
        status, body = post_json(vlm.url + "/v1/chat/completions",
                                 {"model": vlm.model_id, "messages": messages,
                                  "logit_bias": no_eos(vlm),  # no reply ends before the fault
                                  "kvroute_fault": f"decode_error:{step}"})
        assert status == 500, body
        repeat = chat(vlm, messages, **GREEDY).body
        assert cached(repeat) == prompt_tokens(repeat) - 1
        assert_same_answer(repeat, cold(vlm, messages, **GREEDY))
    assert_entries_consistent(vlm)
    assert vlm.health()["vision"]["held"] == 0  # every request let its images go


def test_image_disconnect_mid_prefill_resumes_exactly(vlm):
    messages = conversation(*(image_url(40 + i) for i in range(6)))
    # The header's length first: asked while the stream prefills, the answer came after
    # that whole prefill on a slow machine, and the wait below never saw it midway.
    header = chat(vlm, messages[:1] + [{"role": "user", "content": "hi"}], scope="probe",
                  max_tokens=1).body
    stream = SSEStream(vlm.url + "/v1/chat/completions",
                       {"model": vlm.model_id, "messages": messages, "max_tokens": 4,
                        "kvroute_fault": "slow_prefill:0.05"})

    def past_header():
        jobs = vlm.health()["engine"]["jobs"]
        return [j for j in jobs if j["phase"] == "prefill"
                and j["processed"] >= prompt_tokens(header) + 40]

    wait_until(past_header, timeout=60, what="prefill into the images")
    stream.close()
    wait_until(lambda: idle(vlm), timeout=10, what="the prefill to be abandoned")
    retry = chat(vlm, messages, **GREEDY).body
    assert cached(retry) >= prompt_tokens(header) - 12
    assert_same_answer(retry, cold(vlm, messages, **GREEDY))
    assert_entries_consistent(vlm)


def test_image_prompt_restored_from_disk_after_restart(vlm_model, tmp_path):
    def start(port: int | None = None) -> BackendProcess:
        proc = BackendProcess(vlm_model, model_id="vlm", log_dir=tmp_path, port=port,
                              extra=["--prefill-step", "32", "--disk-cache-dir",
                                     str(tmp_path / "disk")])
        proc.start()
        return proc

    first = start()
    messages = conversation(image_url(50), image_url(51))
    try:
        turn1 = chat(first, messages, **GREEDY).body
        wait_until(lambda: (d := first.health()["disk"])["entries"] >= 1
                   and d["write_queue"] == 0, 60, what="turn 1 on disk")
    finally:
        first.stop()
    again = start(first.port)
    try:
        repeat = chat(again, messages, **GREEDY).body
        assert cached(repeat) == prompt_tokens(repeat) - 1  # from disk, images included
        assert again.health()["vision"]["encoded"] == 0  # the encoder never ran
        assert_same_answer(repeat, turn1)
    finally:
        again.stop()


def test_concurrent_image_prompts_batch_exactly(vlm):
    """Prompts with different images prefilled and decoded in one batch each answer as
    alone (the vision step embeds several images of several rows in one chunk)."""
    from concurrent.futures import ThreadPoolExecutor

    conversations = [conversation(image_url(60 + i), image_url(70 + i)) for i in range(4)]
    alone = [cold(vlm, m, **GREEDY) for m in conversations]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda m: cold(vlm, m, **GREEDY), conversations))
    for a, b in zip(together, alone):
        assert_same_answer(a, b)
    assert vlm.health()["engine"]["peak_batch"] >= 2


def test_a_one_token_prefill_chunk_of_an_image_is_embedded(vlm_model):
    """A prefill chunk can be one token wide (a segment's tail): an image id there is
    embedded like in any chunk. Logits of a prompt prefilled whole and in chunks of
    which one is a single image id agree."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvroute.backend.mlx_patches import prefilling
    from kvroute.backend.vision import VisionModel, load_vision

    model, tokenizer, config = load(str(vlm_model), return_config=True)
    vision = load_vision(str(vlm_model), config, model, tokenizer)
    wrapped = VisionModel(model, vision)
    pixels = vision.prompt.pixels(image_url(80))
    text = "look " + pixels.text + " now"
    tokens = vision.prompt.substitute(tokenizer.encode(text, add_special_tokens=False), [pixels])
    at = next(i for i, t in enumerate(tokens) if t < 0) + 3  # an image id inside the run
    vision.hold([pixels])
    try:
        def last_logits(cuts: list[int]) -> mx.array:
            cache, out = make_prompt_cache(wrapped), None
            with prefilling():
                for a, b in zip(cuts, cuts[1:]):
                    out = wrapped(mx.array([tokens[a:b]]), cache=cache)
            return out[0, -1]

        whole = last_logits([0, len(tokens)])
        narrow = last_logits([0, at, at + 1, len(tokens)])
        assert mx.abs(whole - narrow).max().item() < 1e-4
    finally:
        vision.release([pixels])


def test_demo_model_cli_builds_a_vlm(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "demo-model", str(tmp_path / "m"),
                          "--vision", "mistral3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "mistral3" and "vision_config" in config
    refused = subprocess.run([sys.executable, "-m", "kvroute.cli", "demo-model", str(tmp_path / "n"),
                              "--vision", "gemma3", "--arch", "qwen3"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "--vision takes no --arch" in refused.stderr
