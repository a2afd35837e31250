"""Documents in prompts: PDFs and text files a request sends as content (OpenAI's `file` parts,
the Responses API's `input_file`, Anthropic's `document` blocks), by value or as files uploaded
to the Files API, read to text for the model.

The APIs' translations put a `document` part (`part`) where a file stands in a message; `read`
turns each into a text part on the worker thread that prepares the prompt, so that a PDF's text
is extracted off the event loop; an image named by an uploaded file's id (`image_part`) becomes
an image part of its bytes there too. The model reads each file in a `<document>` element
naming it. A PDF is read as its pages' text: what is drawn and not written (a scanned page, a
chart) is not seen, and a PDF with no text at all is refused by name rather than shown as
nothing. A document by http(s) URL is fetched only where the server fetches media
(`--allow-media-fetch`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import mimetypes
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from inflight.server.errors import ServerError
from inflight.server.files import FileStore

# A file's bound as a document (an upload may be larger: a batch's input), and a PDF's pages:
# Anthropic's bounds on a request's PDF.
MAX_BYTES = 32 << 20
MAX_PAGES = 100
# Texts of the PDFs read last, by their bytes' digest: a context edit counts a conversation's
# tokens several times, and a chat sends its files again with every turn.
CACHED_PDFS = 16
# Seconds a document's URL may take, as an image's.
FETCH_TIMEOUT = 10.0
# Media types read as text beside text/*.
_TEXT_TYPES = {"application/json", "application/xml", "application/x-yaml", "application/yaml"}


@dataclass(frozen=True)
class Document:
    """A file in a message: its bytes (`data`, or `base64` decoded when read), an uploaded
    file's id, or an http(s) URL; `media_type` as declared (None: a PDF told by its first
    bytes, else UTF-8 text);
    `name` (file name or title) and `context` shown to the model with it; `where` the request's
    field, which a refusal names."""

    where: str
    data: bytes | None = None
    base64: str | None = None
    file_id: str | None = None
    url: str | None = None
    media_type: str | None = None
    name: str | None = None
    context: str | None = None


def part(document: Document) -> dict[str, Any]:
    """A content part holding `document`, for `read` to turn into text."""
    return {"type": "document", "document": document}


def image_part(document: Document) -> dict[str, Any]:
    """A content part holding an uploaded image (`document.file_id`), for `read` to turn into
    an image part of its bytes."""
    return {"type": "uploaded_image", "document": document}


def sent_file(
    where: str,
    file_data: str | None,
    file_id: str | None,
    name: str | None,
    file_url: str | None = None,
) -> Document:
    """The document of OpenAI's file fields: `file_data` (a data URL,
    `data:application/pdf;base64,...`, or bare base64), an uploaded file's `file_id`, or (the
    Responses API's) a `file_url`."""
    if sum(field is not None for field in (file_data, file_id, file_url)) != 1:
        raise ServerError(400, "a file needs one of file_data and file_id (or file_url)", where)
    if file_id is not None:
        return Document(f"{where}.file_id", file_id=file_id, name=name)
    if file_url is not None:
        return Document(f"{where}.file_url", url=file_url, name=name)
    where = f"{where}.file_data"
    if not (file_data or "").startswith("data:"):
        return Document(where, base64=file_data, name=name)
    header, sep, payload = (file_data or "").partition(",")
    if not sep or not header.endswith(";base64"):
        raise ServerError(400, "file_data must be base64 or a data:<type>;base64,... URL", where)
    return Document(where, base64=payload, media_type=header[5:-7] or None, name=name)


class DocumentReader:
    """Reads documents to text, uploaded ones from `files`, those by URL only where
    `allow_fetch`."""

    def __init__(self, files: FileStore, allow_fetch: bool = False) -> None:
        self.files = files
        self.allow_fetch = allow_fetch
        self._pdfs: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with each document part as a text part of the document, and each
        uploaded image as an image part of its bytes; a tool message's parts joined into its
        text (templates render a tool result as a string). Messages without either come back
        as they are."""
        out = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list) or not any(_kind(p) for p in content):
                out.append(message)
                continue
            parts = [self._part(p) if _kind(p) else p for p in content]
            if message.get("role") == "tool":
                out.append({**message, "content": "".join(p["text"] for p in parts)})
            else:
                out.append({**message, "content": parts})
        return out

    def _part(self, part: dict[str, Any]) -> dict[str, Any]:
        document = part["document"]
        if _kind(part) == "document":
            return {"type": "text", "text": self.text(document)}
        stored = self.files.find(document.file_id, document.where)
        # The image's own bytes tell its format (the type in the URL is not read).
        kind = mimetypes.guess_type(stored.filename)[0] or ""
        kind = kind if kind.startswith("image/") else "image/png"
        encoded = base64.b64encode(stored.content).decode()
        return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{encoded}"}}

    def text(self, document: Document) -> str:
        """The document as the model reads it: its text in a `<document>` element."""
        data, name, media_type = self._bytes(document)
        body = self._content(data, media_type, document.where).strip("\n")
        label = f' name="{_attribute(name)}"' if name else ""
        context = f"<context>{document.context}</context>\n" if document.context else ""
        return f"<document{label}>\n{context}{body}\n</document>\n"

    def _bytes(self, document: Document) -> tuple[bytes, str | None, str | None]:
        """The document's bytes, name and declared media type."""
        name, media_type = document.name, document.media_type
        if document.file_id is not None:
            stored = self.files.find(document.file_id, document.where)
            data, name = stored.content, name or stored.filename
        elif document.url is not None:
            data, served_type = self._fetch(document.url, document.where)
            name = name or urllib.parse.urlsplit(document.url).path.rsplit("/", 1)[-1] or None
            media_type = media_type or served_type
        elif document.base64 is not None:
            try:
                data = base64.b64decode(document.base64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ServerError(
                    400, f"the file's data is not valid base64: {exc}", document.where
                ) from exc
        else:
            data = document.data or b""
        if len(data) > MAX_BYTES:
            raise ServerError(
                413, f"the file is {len(data)} bytes; a document's limit is {MAX_BYTES}",
                document.where,
            )  # fmt: skip
        if media_type is None and name:
            media_type = mimetypes.guess_type(name)[0]
        return data, name, media_type

    def _fetch(self, url: str, where: str) -> tuple[bytes, str | None]:
        """The bytes at an http(s) URL and the media type it was served as (None where that
        says nothing: octet-stream)."""
        if not url.startswith(("http://", "https://")):
            raise ServerError(400, "a document's URL must be an http(s) URL", where)
        if not self.allow_fetch:
            raise ServerError(
                400,
                "fetching document URLs is disabled on this server (start it with "
                "--allow-media-fetch); send the file's data",
                where,
            )
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as reply:
                data = reply.read(MAX_BYTES + 1)
                served = reply.headers.get_content_type()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ServerError(400, f"cannot fetch the document at {url}: {exc}", where) from exc
        if len(data) > MAX_BYTES:
            raise ServerError(413, f"the document at {url} is over {MAX_BYTES} bytes", where)
        return data, None if served == "application/octet-stream" else served

    def _content(self, data: bytes, media_type: str | None, where: str) -> str:
        if media_type == "application/pdf" or data.startswith(b"%PDF-"):
            return self._pdf(data, where)
        if media_type is not None and not _is_text(media_type):
            raise ServerError(
                400,
                f"files of type {media_type!r} are not read; this server reads PDFs and text files",
                where,
            )
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ServerError(
                400,
                "the file is neither a PDF nor UTF-8 text; this server reads PDFs and text files",
                where,
            ) from exc

    def _pdf(self, data: bytes, where: str) -> str:
        key = hashlib.sha256(data).digest()
        with self._lock:
            if key in self._pdfs:
                self._pdfs.move_to_end(key)
                return self._pdfs[key]
        text = _pdf_text(data, where)
        with self._lock:
            self._pdfs[key] = text
            while len(self._pdfs) > CACHED_PDFS:
                self._pdfs.popitem(last=False)
        return text


def _pdf_text(data: bytes, where: str) -> str:
    """A PDF's pages' text, blank lines between them."""
    from pypdf import PdfReader  # ~0.16 s: paid by the first PDF rather than at every start

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ServerError(400, "the PDF is encrypted with a password", where)
        pages = len(reader.pages)
        if pages > MAX_PAGES:
            raise ServerError(400, f"the PDF has {pages} pages; the limit is {MAX_PAGES}", where)
        texts = [page.extract_text() for page in reader.pages]
    except ServerError:
        raise
    except Exception as exc:  # a malformed file can fail anywhere in the parser
        raise ServerError(400, f"the PDF cannot be read: {exc}", where) from exc
    if not any(t.strip() for t in texts):
        raise ServerError(
            400,
            "the PDF has no text to read (scanned pages?); this server reads PDFs' text only",
            where,
        )
    return "\n\n".join(t.strip("\n") for t in texts)


def _kind(part: Any) -> str | None:
    """The type of a part `read` reads (a document, an uploaded image), else None."""
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if kind in ("document", "uploaded_image") else None


def _is_text(media_type: str) -> bool:
    return media_type.startswith("text/") or media_type in _TEXT_TYPES


def _attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")
