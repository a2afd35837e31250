"""The message-thread store: what a continue is served from, and the API's rejections."""

import pytest

from inflight.server.errors import ServerError
from inflight.server.protocol import AnthropicMessagesRequest
from inflight.server.threads import ThreadStore

TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def request(messages, thread, **fields):
    return AnthropicMessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": messages, "thread": thread, **fields}
    )


def user(text):
    return {"role": "user", "content": text}


def create(store, reply_id="msg_1", reply="Hello."):
    body = request([user("Hi")], {"type": "create"}, system="Be brief.", tools=[TOOL])
    turn = store.begin(body)
    turn.keep(reply_id, [{"type": "text", "text": reply}])
    return body


def continuing(previous, messages=None, **fields):
    thread = {"type": "continue", "previous_message_id": previous}
    return request(messages or [user("Again")], thread, **fields)


def rejection(store, body):
    with pytest.raises(ServerError) as info:
        store.begin(body)
    return info.value


def test_a_request_without_a_thread_has_no_turn():
    assert ThreadStore().begin(request([user("Hi")], None)) is None


def test_a_continue_is_served_the_whole_conversation_with_the_threads_system_and_tools():
    store = ThreadStore()
    created = create(store)
    body = continuing("msg_1")
    turn = store.begin(body)
    served = turn.request(body)
    assert served.system == "Be brief."
    assert [t.name for t in served.tools] == ["get_weather"]
    assert [(m.role, m.model_dump()["content"]) for m in served.messages] == [
        ("user", "Hi"),
        ("assistant", [{"type": "text", "text": "Hello."}]),
        ("user", "Again"),
    ]
    assert served.max_tokens == body.max_tokens and created.thread.type == "create"
    # The longer conversation is kept under the new reply, and that one continues it.
    turn.keep("msg_2", [{"type": "text", "text": "Sure."}])
    body = continuing("msg_2", [user("Third")])
    served = store.begin(body).request(body)
    assert [m.role for m in served.messages] == ["user", "assistant", "user", "assistant", "user"]


def test_an_unknown_reply_is_not_found_with_the_apis_error_code():
    error = rejection(ThreadStore(), continuing("msg_nope"))
    assert error.status == 404 and error.details == {"error_code": "thread_not_found"}
    assert "msg_nope" in error.message


def test_a_reply_is_continued_once():
    store = ThreadStore()
    create(store)
    store.begin(continuing("msg_1")).keep("msg_2", [{"type": "text", "text": "Sure."}])
    error = rejection(store, continuing("msg_1"))
    assert error.status == 400 and error.details == {"error_code": "thread_already_continued"}


def test_one_continue_at_a_time_and_a_failed_one_frees_the_reply():
    store = ThreadStore()
    create(store)
    turn = store.begin(continuing("msg_1"))
    error = rejection(store, continuing("msg_1"))
    assert error.status == 400 and error.details == {"error_code": "thread_continue_in_flight"}
    turn.release()
    store.begin(continuing("msg_1"))  # served again: the failed turn kept nothing


def test_a_kept_conversation_expires():
    now = [0.0]
    store = ThreadStore(ttl_s=300, clock=lambda: now[0])
    create(store)
    now[0] = 300.5
    assert rejection(store, continuing("msg_1")).details == {"error_code": "thread_not_found"}


def test_the_store_is_bounded_least_recently_used_out():
    store = ThreadStore(capacity=2)
    for i in range(3):
        create(store, reply_id=f"msg_{i}")
    assert rejection(store, continuing("msg_0")).status == 404
    store.begin(continuing("msg_2"))


@pytest.mark.parametrize("field", ["system", "tools"])
def test_a_continue_may_not_resend_the_threads_system_or_tools(field):
    store = ThreadStore()
    create(store)
    value = {"system": "Other.", "tools": [TOOL]}[field]
    error = rejection(store, continuing("msg_1", **{field: value}))
    assert error.status == 400 and error.param == field and error.details is None


def test_a_reply_to_a_prefill_extends_the_final_assistant_message():
    store = ThreadStore()
    messages = [user("Hi"), {"role": "assistant", "content": "Well,"}]
    store.begin(request(messages, {"type": "create"})).keep(
        "msg_1", [{"type": "text", "text": " hello."}]
    )
    served = store.begin(continuing("msg_1")).request(continuing("msg_1"))
    assert [(m.role, m.model_dump()["content"]) for m in served.messages] == [
        ("user", "Hi"),
        ("assistant", [{"type": "text", "text": "Well,"}, {"type": "text", "text": " hello."}]),
        ("user", "Again"),
    ]
