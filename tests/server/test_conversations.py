"""Conversations of the Conversations API: items as they are kept, and the bounded store."""

import pytest

from inflight.server.conversations import MAX_ITEMS, ConversationStore, item_object, item_objects
from inflight.server.errors import ServerError
from inflight.server.responses_protocol import INPUT_ITEM


def item(value):
    return INPUT_ITEM.validate_python(value)


def test_items_are_kept_with_ids_a_status_and_content_parts():
    user = item_object(item({"role": "user", "content": "Hi"}), "items.0")
    assert user["id"].startswith("msg_") and user["status"] == "completed"
    assert user["content"] == [{"type": "input_text", "text": "Hi"}]
    reply = item_object(item({"type": "message", "role": "assistant", "content": "Hello"}), "x")
    assert reply["content"] == [{"type": "output_text", "text": "Hello"}]
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert item_object(item(call), "x") == {**call, "status": "completed"}
    output = item_object(
        item({"type": "function_call_output", "call_id": "c1", "output": "7"}), "x"
    )
    assert output["id"].startswith("fco_")
    # What is kept reads back as the input item it came from.
    assert item(user).content[0].text == "Hi" and item(output).output == "7"


def test_an_item_of_another_type_and_too_many_items_are_refused():
    with pytest.raises(ServerError) as info:
        item_object(item({"type": "web_search_call", "id": "ws_1"}), "items.0")
    assert info.value.status == 400 and info.value.param == "items.0"
    many = [item({"role": "user", "content": "Hi"})] * (MAX_ITEMS + 1)
    with pytest.raises(ServerError) as info:
        item_objects(many, "items")
    assert info.value.status == 400 and str(MAX_ITEMS) in info.value.message


def test_the_store_is_bounded_and_names_the_field_of_an_unknown_id():
    store = ConversationStore(capacity=2)
    first, second = store.create([], {}), store.create([], {"k": "v"})
    store.get(first.id)  # used: the second is now the least recently used
    store.create([], {})
    with pytest.raises(ServerError) as info:
        store.get(second.id, "conversation")
    assert info.value.status == 404 and info.value.param == "conversation"
    store.delete(first.id)
    with pytest.raises(ServerError):
        store.get(first.id)
