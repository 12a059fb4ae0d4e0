"""Stored responses of ``POST /v1/responses`` (``store``, ``GET``/``DELETE /v1/responses/{id}``,
``previous_response_id``, ``background`` and ``/cancel``) through the real app over HTTP with the
OpenAI SDK, on the tiny random Llama with SmolLM2's vocabulary and tokenizer, in this process.

The server keeps at most ``BOUND`` responses, so that eviction is cheap to reach. Tests that read
the engine's ``stats()`` (a cancel aborts its engine request) run on the in-process service."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.frontend.responses_protocol import ResponsesRequest, chat_messages, conversation_after, input_messages
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service

MODEL = "tiny"
BOUND = 4
"""The test server's ``responses_store_size``."""
LONG_ASK = {"input": "Tell me everything.", "max_output_tokens": 400, "temperature": 0}
"""A response that still runs when it is cancelled or cut short (greedy, this model's gibberish for
it meets the limit: no EOS ends it early)."""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152)
    svc = start_service(Path(checkpoint), *TINY_ENGINE, "engine.num_pages=256")
    yield svc
    svc.shutdown()


def serve(service, **options) -> LiveServer:
    return LiveServer(create_app(service, served_model_name=MODEL, **options))


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live(service) -> Iterator[LiveServer]:
    server = serve(service, responses_store_size=BOUND)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return sdk(live)


def idle(service, timeout: float = 30) -> bool:
    """Whether the engine runs no request (waiting up to ``timeout`` for it)."""
    deadline = time.monotonic() + timeout
    while service.stats().running or service.stats().waiting:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def poll(client: openai.OpenAI, response_id: str, until: tuple[str, ...], timeout: float = 60):
    """The stored response once its status is one of ``until``."""
    deadline = time.monotonic() + timeout
    while (found := client.responses.retrieve(response_id)).status not in until:
        assert time.monotonic() < deadline, found.status
        time.sleep(0.05)
    return found


def test_a_stored_response_is_retrieved_as_created(client) -> None:
    created = client.responses.create(model=MODEL, input="Hello there.", max_output_tokens=6, temperature=0)
    assert created.store is True and created.background is False and created.output_text
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()


def test_store_false_is_not_kept(client) -> None:
    created = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=2, store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(created.id)
    assert created.id in caught.value.body["message"]


def test_a_streamed_response_is_stored_as_its_final_event(client) -> None:
    # (Not ``responses.stream``: its final response must be a response.completed, and the gibberish
    # usually meets max_output_tokens: response.incomplete.)
    events = list(client.responses.create(model=MODEL, input="Tell me a joke.", max_output_tokens=6, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and final.store is True and final.output_text
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_the_oldest_responses_are_dropped_beyond_the_bound(client) -> None:
    ids = [client.responses.create(model=MODEL, input=f"Count {i}.", max_output_tokens=1).id for i in range(BOUND + 2)]
    for dropped in ids[:2]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(dropped)
    assert [client.responses.retrieve(i).id for i in ids[2:]] == ids[2:]


def test_delete_then_not_found(client, live) -> None:
    created = client.responses.create(model=MODEL, input="Forget me.", max_output_tokens=2)
    r = httpx.delete(f"{live.url}/v1/responses/{created.id}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    ask = {"role": "user", "content": "What is my name?"}
    then = dict(max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input=[ask], previous_response_id=first.id, **then)
    assert second.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input=[ask], store=False, **then)
    assert second.usage.input_tokens > alone.usage.input_tokens + 5
    # As OpenAI's: the previous input and output items come first, its instructions do not.
    history = [{"role": "user", "content": "My name is Ada."}, *(o.model_dump(exclude_none=True) for o in first.output)]
    resent = client.responses.create(model=MODEL, input=[*history, ask], store=False, **then)
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.output_text == second.output_text

    with pytest.raises(openai.BadRequestError) as caught:  # OpenAI's answer: 400, not 404
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown", max_output_tokens=2)
    error = caught.value.body
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"


def test_background_is_queued_then_completed(client) -> None:
    created = client.responses.create(
        model=MODEL, input="Write a poem.", max_output_tokens=8, temperature=0, background=True
    )
    assert created.status == "queued" and created.background is True and created.output == []
    done = poll(client, created.id, ("completed", "incomplete"))
    assert done.output_text and done.usage.output_tokens >= 1 and done.background is True
    foreground = client.responses.create(model=MODEL, input="Write a poem.", max_output_tokens=8, temperature=0)
    assert done.output_text == foreground.output_text
    assert client.responses.cancel(created.id).model_dump() == done.model_dump()  # ended: unchanged


def test_cancel_a_background_response_aborts_it(client, service) -> None:
    created = client.responses.create(model=MODEL, background=True, **LONG_ASK)
    assert poll(client, created.id, ("in_progress",)).status == "in_progress"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert idle(service)


def test_only_background_responses_can_be_cancelled(client) -> None:
    created = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "stream"),
    ],
)
def test_background_needs_store_and_no_stream(live, body, param) -> None:
    r = httpx.post(f"{live.url}/v1/responses", json={"model": MODEL, "input": "hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_without_storage_nothing_is_stored(service) -> None:
    server = serve(service, responses_store_size=0)
    try:
        client = sdk(server)
        served = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2)
        assert served.store is False
        for asked, param in (
            ({"store": True}, "store"),
            ({"background": True}, "background"),
            ({"previous_response_id": served.id}, "previous_response_id"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, **asked)
            assert caught.value.body["param"] == param
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(served.id)
    finally:
        server.stop()


def test_a_failed_background_response_is_stored_failed(service) -> None:
    server = serve(service, request_timeout_s=0.05)
    try:
        client = sdk(server)
        created = client.responses.create(model=MODEL, background=True, **LONG_ASK)
        failed = poll(client, created.id, ("failed",))
        assert failed.error.code == "request_timeout" and failed.error.message and failed.output == []
        assert idle(service)
    finally:
        server.stop()


def test_shutdown_cancels_background_responses(service) -> None:
    server = serve(service)
    client = sdk(server)
    created = client.responses.create(model=MODEL, background=True, **LONG_ASK)
    assert poll(client, created.id, ("in_progress",)).status == "in_progress"
    server.stop()
    assert idle(service)


def test_a_conversation_continues_without_changing_the_stored_one() -> None:
    req = ResponsesRequest.model_validate({"model": MODEL, "instructions": "Be kind.", "input": "Weather?"})
    output = [
        {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}],
        },
        {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    stored = conversation_after(input_messages(req), output)
    assert stored == [  # no instructions: they are not carried over
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    before = copy.deepcopy(stored)
    more = {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"}
    then = ResponsesRequest.model_validate({"model": MODEL, "instructions": "Be brief.", "input": [more]})
    messages = chat_messages(then, stored)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [c["id"] for c in messages[-1]["tool_calls"]] == ["c1", "c2"]  # joined the last assistant message
    assert stored == before
