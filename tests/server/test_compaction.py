"""Compaction items: this server's encoding of a summary, refused when another service wrote
it, rendered in a prompt as a user message holding the summary, kept as an item."""

import base64

import pytest

from inflight.server import compaction
from inflight.server.conversations import item_object
from inflight.server.errors import ServerError
from inflight.server.responses import chat_messages
from inflight.server.responses_protocol import INPUT_ITEM, CompactionItem


def test_a_summary_round_trips_through_its_item():
    summary = "The user, Ada, builds a JSON parser in Rust; tests pass; next: errors. é ✓"
    content = compaction.encode(summary)
    assert compaction.summary_of(content, "input.0.encrypted_content") == summary


@pytest.mark.parametrize(
    "content",
    [
        "gAAAAABpZm9yZWlnbg==",  # another service's (OpenAI's are Fernet tokens)
        compaction.encode("x")[:-2] + "!!",  # altered
        compaction.encode("x").split(":", 1)[0] + ":" + base64.b64encode(b"\xff\xfe").decode(),
    ],
)
def test_a_compaction_this_server_did_not_write_is_refused_by_name(content):
    with pytest.raises(ServerError) as info:
        compaction.summary_of(content, "input.3.encrypted_content")
    assert info.value.status == 400 and info.value.param == "input.3.encrypted_content"
    assert "not written by this server" in info.value.message


def test_a_compaction_item_stands_in_the_prompt_as_a_user_message_with_its_summary():
    items = [
        INPUT_ITEM.validate_python({"role": "user", "content": "Build a parser."}),
        INPUT_ITEM.validate_python(
            {"type": "compaction", "id": "cmp_1", "encrypted_content": compaction.encode("S.")}
        ),
        INPUT_ITEM.validate_python({"role": "user", "content": "Go on."}),
    ]
    assert isinstance(items[1], CompactionItem)
    messages = chat_messages("Be brief.", items, 0)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Build a parser."},
        {"role": "user", "content": f"{compaction.SUMMARY_HEADER}\n\nS."},
        {"role": "user", "content": "Go on."},
    ]
    with pytest.raises(ServerError) as info:
        chat_messages(
            None, [INPUT_ITEM.validate_python({"type": "compaction", "encrypted_content": "x"})], 0
        )
    assert info.value.param == "input.0.encrypted_content"


def test_a_compaction_item_is_kept_with_its_id_and_no_status():
    item = INPUT_ITEM.validate_python({"type": "compaction", "encrypted_content": "c"})
    kept = item_object(item, "items.0")
    assert kept["type"] == "compaction" and kept["encrypted_content"] == "c"
    assert kept["id"].startswith("cmp_") and "status" not in kept
    given = INPUT_ITEM.validate_python(
        {"type": "compaction", "id": "cmp_9", "encrypted_content": "c"}
    )
    assert item_object(given, "items.0")["id"] == "cmp_9"
