"""Documents in prompts: PDFs and text files read to text (`server/documents.py`), and sent
through the three APIs by the official clients, as data and as uploaded files."""

import base64

import anthropic
import httpx
import openai
import pytest

from inflight.server import documents
from inflight.server.documents import Document, DocumentReader
from inflight.server.errors import ServerError
from inflight.server.files import FileStore

from helpers import serving_files
from pdfs import pdf
from server_harness import prompt_of

MODEL = "test-model"
REPORT = pdf([["Quarterly revenue was 42 units.", "Costs (fixed) were 7."], ["Page two: hello."]])
# The report as the model reads it: its pages' text in a document element naming it.
READ = (
    '<document name="report.pdf">\n'
    "Quarterly revenue was 42 units.\nCosts (fixed) were 7.\n\nPage two: hello.\n"
    "</document>\n"
)
QUESTION = "What was the revenue?"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _refusal(document: Document, status: int = 400, store: FileStore | None = None) -> str:
    with pytest.raises(ServerError) as info:
        DocumentReader(store or FileStore()).text(document)
    assert info.value.status == status and info.value.param == document.where
    return info.value.message


# -- reading -----------------------------------------------------------------------------------


def test_a_pdf_is_read_as_its_pages_text_in_order():
    reader = DocumentReader(FileStore())
    assert reader.text(Document("f", data=REPORT, name="report.pdf")) == READ
    # Told by its first bytes without a type or a name; by its name's type; from base64.
    plain = READ.replace(' name="report.pdf"', "")
    assert reader.text(Document("f", data=REPORT)) == plain
    from_b64 = Document("f", base64=_b64(REPORT), media_type="application/pdf", name="report.pdf")
    assert reader.text(from_b64) == READ


def test_text_files_and_what_is_shown_with_a_document():
    reader = DocumentReader(FileStore())
    text = "\ufeffline one\nline two\n".encode()  # a byte order mark is not text
    shown = Document("f", data=text, name='notes "v2".md', context="From the wiki.")
    assert reader.text(shown) == (
        '<document name="notes &quot;v2&quot;.md">\n<context>From the wiki.</context>\n'
        "line one\nline two\n</document>\n"
    )
    assert reader.text(Document("f", data=b"{}", media_type="application/json")) == (
        "<document>\n{}\n</document>\n"
    )


def test_file_fields_as_openai_sends_them():
    data_url = documents.sent_file("p", f"data:application/pdf;base64,{_b64(REPORT)}", None, "r")
    assert data_url == Document(
        "p.file_data", base64=_b64(REPORT), media_type="application/pdf", name="r"
    )
    assert documents.sent_file("p", "aGk=", None, None) == Document("p.file_data", base64="aGk=")
    assert documents.sent_file("p", None, "file-1", "x") == Document(
        "p.file_id", file_id="file-1", name="x"
    )
    for fields in ((None, None), ("aGk=", "file-1")):
        with pytest.raises(ServerError, match="one of file_data and file_id") as info:
            documents.sent_file("p", *fields, None)
        assert info.value.param == "p"
    with pytest.raises(ServerError, match="data:<type>;base64") as info:
        documents.sent_file("p", "data:text/plain,hello", None, None)
    assert info.value.param == "p.file_data"


def test_what_cannot_be_read_is_refused_naming_the_part(monkeypatch):
    assert "not valid base64" in _refusal(Document("m.0", base64="not base64!"))
    docx = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
    assert repr(docx) in _refusal(Document("m.1", data=b"PK\x03\x04", media_type=docx))
    # The type a name gives: a file named .pdf read as one.
    assert "cannot be read" in _refusal(Document("m.2", data=b"plain words", name="a.pdf"))
    assert "neither a PDF nor UTF-8 text" in _refusal(Document("m.3", data=b"\xff\xfe\x00"))
    assert "no text to read" in _refusal(Document("m.4", data=pdf([[], []])))
    assert "cannot be read" in _refusal(Document("m.5", data=b"%PDF-1.4\nnot a pdf at all"))
    monkeypatch.setattr(documents, "MAX_PAGES", 1)
    assert "2 pages; the limit is 1" in _refusal(Document("m.6", data=REPORT))
    monkeypatch.setattr(documents, "MAX_BYTES", 10)
    assert "limit is 10" in _refusal(Document("m.7", data=b"x" * 11), 413)
    assert "no file with id 'file-x'" in _refusal(Document("m.8", file_id="file-x"), 404)


@pytest.fixture(scope="module")
def files_at():
    """An http server on loopback serving the report (as a PDF, and as octet-stream bytes under
    a name) and a text file: its base URL."""
    served = {
        "/report.pdf": ("application/pdf", REPORT),
        "/download?id=7": ("application/octet-stream", REPORT),
        "/notes": ("text/plain; charset=utf-8", b"line one"),
    }
    with serving_files(served) as url:
        yield url


def test_a_document_by_url_is_fetched_only_where_media_are(files_at):
    reader = DocumentReader(FileStore(), allow_fetch=True)
    # Named by its URL's last segment, typed as served (or, served as bytes, by its first bytes).
    assert reader.text(Document("u", url=f"{files_at}/report.pdf")) == READ
    assert reader.text(Document("u", url=f"{files_at}/download?id=7", name="report.pdf")) == READ
    assert reader.text(Document("u", url=f"{files_at}/notes")) == (
        '<document name="notes">\nline one\n</document>\n'
    )
    for url, refusal in (
        (f"{files_at}/missing", "cannot fetch the document"),
        ("file:///etc/passwd", r"must be an http\(s\) URL"),
    ):
        with pytest.raises(ServerError, match=refusal) as info:
            reader.text(Document("u", url=url))
        assert info.value.status == 400 and info.value.param == "u"
    assert "--allow-media-fetch" in _refusal(Document("u", url=f"{files_at}/report.pdf"))


def test_an_uploaded_file_is_read_under_its_name():
    store = FileStore()
    stored = store.add(REPORT, "report.pdf", "user_data")
    assert DocumentReader(store).text(Document("f", file_id=stored.id)) == READ
    # A name sent with the part is the one shown.
    shown = DocumentReader(store).text(Document("f", file_id=stored.id, name="q3.pdf"))
    assert shown == READ.replace("report.pdf", "q3.pdf")
    # An expired file is gone, though the store forgets it only on the event loop.
    stored.expires_at = 1
    assert "no file with id" in _refusal(Document("f", file_id=stored.id), 404, store)


def test_a_pdf_is_parsed_once_for_a_conversations_several_counts(monkeypatch):
    parsed = []
    real = documents._pdf_text
    monkeypatch.setattr(documents, "_pdf_text", lambda *a: parsed.append(1) or real(*a))
    reader = DocumentReader(FileStore())
    for _ in range(3):
        assert reader.text(Document("f", data=REPORT, name="report.pdf")) == READ
    assert len(parsed) == 1


def test_messages_get_their_documents_as_text():
    reader = DocumentReader(FileStore())
    plain = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    report = documents.part(Document("f", data=REPORT, name="report.pdf"))
    messages = [
        plain,
        {"role": "user", "content": [report, {"type": "text", "text": QUESTION}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "A: "}, report]},
    ]
    read = reader.read(messages)
    assert read[0] is plain  # nothing to read: as it was
    assert read[1]["content"] == [{"type": "text", "text": READ}, messages[1]["content"][1]]
    assert read[2] == {"role": "tool", "tool_call_id": "c", "content": f"A: {READ}"}


# -- through the APIs --------------------------------------------------------------------------


def _tokens(handle, messages):
    reply = httpx.post(handle.url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def _inline(*texts):
    return [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]


@pytest.mark.slow
def test_chat_reads_a_pdf_sent_as_data_or_as_an_uploaded_file(oa, handle):
    inline = _inline(READ, QUESTION)
    expected = _tokens(handle, inline)
    uploaded = oa.files.create(file=("report.pdf", REPORT), purpose="user_data")
    sent = [
        {"file_data": f"data:application/pdf;base64,{_b64(REPORT)}", "filename": "report.pdf"},
        {"file_id": uploaded.id},  # shown under its uploaded name
    ]
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    want = oa.chat.completions.create(messages=inline, **greedy)
    for file in sent:
        messages = [
            {
                "role": "user",
                "content": [{"type": "file", "file": file}, {"type": "text", "text": QUESTION}],
            }
        ]
        assert _tokens(handle, messages) == expected
        reply = oa.chat.completions.create(messages=messages, **greedy)
        assert reply.choices[0].message.content == want.choices[0].message.content
        assert reply.usage.prompt_tokens == want.usage.prompt_tokens
    oa.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError) as info:
        oa.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "file", "file": sent[1]}]}], **greedy
        )
    assert info.value.body["param"] == "messages.0.content.0.file.file_id"
    scanned = {"file_data": _b64(pdf([[]])), "filename": "scan.pdf"}
    with pytest.raises(openai.BadRequestError, match="no text to read") as info:
        oa.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "file", "file": scanned}]}], **greedy
        )
    assert info.value.body["param"] == "messages.0.content.0.file.file_data"


@pytest.mark.slow
def test_responses_read_input_files_in_messages_and_tool_outputs(oa):
    greedy = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
    want = oa.responses.create(input=[{"role": "user", "content": READ + QUESTION}], **greedy)
    uploaded = oa.files.create(file=("report.pdf", REPORT), purpose="user_data")
    for file in ({"file_id": uploaded.id}, {"file_data": _b64(REPORT), "filename": "report.pdf"}):
        content = [{"type": "input_file", **file}, {"type": "input_text", "text": QUESTION}]
        asked = [{"role": "user", "content": content}]
        assert oa.responses.input_tokens.count(model=MODEL, input=asked).input_tokens == (
            want.usage.input_tokens
        )
        reply = oa.responses.create(input=asked, **greedy)
        assert reply.output_text == want.output_text
    # A function's output holding a file: read into the tool message's text.
    call = {"type": "function_call", "call_id": "c1", "name": "fetch", "arguments": "{}"}
    tool = {"type": "function", "name": "fetch", "parameters": {"type": "object"}}
    as_text = [call, {"type": "function_call_output", "call_id": "c1", "output": READ}]
    as_file = [
        call,
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_file", "file_id": uploaded.id}],
        },
    ]

    def count(items):
        counted = oa.responses.input_tokens.count
        return counted(model=MODEL, input=items, tools=[tool], tool_choice="none").input_tokens

    assert count(as_file) == count(as_text)
    with pytest.raises(openai.BadRequestError, match="--allow-media-fetch") as info:
        url = [{"type": "input_file", "file_url": "https://example.com/report.pdf"}]
        oa.responses.create(input=[{"role": "user", "content": url}], **greedy)
    assert info.value.body["param"] == "input.0.content.0.file_url"
    oa.files.delete(uploaded.id)


@pytest.mark.slow
def test_anthropic_document_blocks_are_read(claude, handle):
    greedy = {"model": MODEL, "max_tokens": 6, "extra_body": {"temperature": 0}}

    def asked(*blocks):
        return [{"role": "user", "content": [*blocks, {"type": "text", "text": QUESTION}]}]

    def counted(messages):
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    want = claude.messages.create(messages=asked({"type": "text", "text": READ}), **greedy)
    pdf_block = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": _b64(REPORT)},
        "title": "report.pdf",
    }
    text = "Quarterly revenue was 42 units.\nCosts (fixed) were 7.\n\nPage two: hello."
    text_block = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": text},
        "title": "report.pdf",
    }
    pages = [text.split("\n\n")[0], "Page two: hello."]
    content_block = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": p} for p in pages]},
        "title": "report.pdf",
    }
    for block in (pdf_block, text_block):
        assert counted(asked(block)) == prompt_of(want.usage)
        reply = claude.messages.create(messages=asked(block), **greedy)
        assert reply.content[0].text == want.content[0].text
    # Text blocks one a line; a context shown before the text.
    joined = READ.replace("\n\nPage two", "\nPage two")
    assert counted(asked(content_block)) == counted(asked({"type": "text", "text": joined}))
    with_context = {**text_block, "context": "From the board."}
    shown = READ.replace("\nQuarterly", "\n<context>From the board.</context>\nQuarterly")
    assert counted(asked(with_context)) == counted(asked({"type": "text", "text": shown}))
    # Citations are not given: the field is named as ignored.
    cited = {**pdf_block, "citations": {"enabled": True}}
    raw = claude.messages.with_raw_response.create(messages=asked(cited), **greedy)
    assert raw.headers["x-inflight-ignored-fields"] == "messages.0.content.0.citations"
    # A tool result holding a document, as a tool that fetches files returns one.
    use = {"type": "tool_use", "id": "t1", "name": "fetch", "input": {}}
    tools = [{"name": "fetch", "input_schema": {"type": "object"}}]

    def result(content):
        return [
            {"role": "user", "content": "Read the report."},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}],
            },
        ]

    def counted_with_tools(messages):
        return claude.messages.count_tokens(
            model=MODEL, messages=messages, tools=tools, tool_choice={"type": "none"}
        )

    assert counted_with_tools(result([pdf_block])).input_tokens == (
        counted_with_tools(result(READ)).input_tokens
    )
    for source, named in (
        ({"type": "url", "url": "https://example.com/r.pdf"}, "--allow-media-fetch"),
        ({"type": "file", "file_id": "file_011"}, "Files API is not served"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=named) as info:
            claude.messages.create(messages=asked({"type": "document", "source": source}), **greedy)
        assert info.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_documents_by_url_where_the_server_fetches_media(oa, claude, handle, files_at):
    # As `inflight serve --allow-media-fetch` has it.
    handle.client.documents.allow_fetch = True
    try:
        inline = [{"role": "user", "content": READ + QUESTION}]
        by_url = {"type": "input_file", "file_url": f"{files_at}/report.pdf"}
        asked = [{"role": "user", "content": [by_url, {"type": "input_text", "text": QUESTION}]}]
        count = oa.responses.input_tokens.count
        assert count(model=MODEL, input=asked).input_tokens == (
            count(model=MODEL, input=inline).input_tokens
        )
        block = {"type": "document", "source": {"type": "url", "url": f"{files_at}/report.pdf"}}
        messages = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
        counted = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
        assert counted == claude.messages.count_tokens(model=MODEL, messages=inline).input_tokens
    finally:
        handle.client.documents.allow_fetch = False
