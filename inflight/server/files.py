"""The OpenAI Files API's store: files uploaded (a batch's input) and the files batches write
(their output and error files), kept in memory, bounded by their total size; a restart forgets
them.

The bound refuses uploads (413 naming it) but never a batch's own output: that output is what
the batch ran, and dropping it would lose the work. It counts, so uploads are refused until
files are deleted.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from inflight.server.conversations import item_page
from inflight.server.errors import ServerError

# The total bytes of the files kept.
CAPACITY_BYTES = 512 * 1024 * 1024
# The largest upload (its multipart body): OpenAI's bound on a batch's input file. Other
# request bodies keep the server's body limit (8 MiB).
UPLOAD_MAX_BYTES = 200 * 1024 * 1024
# The purposes an upload may have: a batch's input, and OpenAI's purpose for any other use.
# The others OpenAI documents feed APIs this server does not serve (see `check_purpose`).
UPLOAD_PURPOSES = ("batch", "user_data")
_UNSERVED_PURPOSES = {
    "assistants": "the Assistants API",
    "fine-tune": "fine-tuning",
    "vision": "vision fine-tuning",
    "evals": "the Evals API",
}
# OpenAI's: a batch input file expires after 30 days unless told otherwise; other files stay.
BATCH_FILE_SECONDS = 30 * 24 * 3600
# The range OpenAI allows for `expires_after.seconds` (an hour to 30 days).
EXPIRY_RANGE = (3600, 30 * 24 * 3600)


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    expires_at: int | None = None

    def as_object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def check_purpose(purpose: str | None) -> str:
    """The purpose of an upload (a 400 naming `purpose` for one this server does not take)."""
    if purpose in UPLOAD_PURPOSES:
        return purpose
    served = " or ".join(repr(p) for p in UPLOAD_PURPOSES)
    if purpose in _UNSERVED_PURPOSES:
        message = (
            f"files with purpose {purpose!r} feed {_UNSERVED_PURPOSES[purpose]}, which this "
            f"server does not serve; it takes purpose {served}"
        )
    elif purpose is None:
        message = f"purpose is required: {served}"
    else:
        message = f"purpose {purpose!r} is not a file purpose this server takes: {served}"
    raise ServerError(400, message, "purpose")


class FileStore:
    """Files by id, in the order they were made, at most `capacity` bytes of them uploaded."""

    def __init__(self, capacity: int = CAPACITY_BYTES) -> None:
        self.capacity = capacity
        self._files: dict[str, StoredFile] = {}
        self.used = 0  # bytes held

    def add(
        self,
        content: bytes,
        filename: str,
        purpose: str,
        expires_after: int | None = None,
        *,
        written: bool = False,
    ) -> StoredFile:
        """Keep a file; an upload (`written` false: not a batch's output) past the bound is a
        413 naming it."""
        self._expire()
        if not written and self.used + len(content) > self.capacity:
            raise ServerError(
                413,
                f"the file is {len(content)} bytes and this server already holds {self.used} of "
                f"its {self.capacity}-byte file store; delete files (DELETE /v1/files/{{id}}) "
                "to make room",
                "file",
            )
        now = int(time.time())
        expires_at = None if expires_after is None else now + expires_after
        stored = StoredFile(f"file-{uuid.uuid4().hex}", filename, purpose, content, now, expires_at)
        self._files[stored.id] = stored
        self.used += len(content)
        return stored

    def get(self, file_id: str, param: str = "file_id") -> StoredFile:
        """The file (a 404 naming `param` where none is kept under that id)."""
        self._expire()
        return self.find(file_id, param)

    def find(self, file_id: str, param: str = "file_id") -> StoredFile:
        """`get` without forgetting the expired files, for a worker thread (a prompt's
        documents): only the event loop changes the store."""
        stored = self._files.get(file_id)
        if stored is None or (stored.expires_at is not None and stored.expires_at <= time.time()):
            raise ServerError(
                404, f"no file with id {file_id!r} (unknown, deleted or expired)", param
            )
        return stored

    def delete(self, file_id: str) -> None:
        stored = self.get(file_id)
        del self._files[file_id]
        self.used -= len(stored.content)

    def page(
        self, purpose: str | None, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        self._expire()
        kept = [f.as_object() for f in self._files.values() if purpose in (None, f.purpose)]
        return item_page(kept, limit, order, after)

    def _expire(self) -> None:
        """Forget the files whose time is up (looked at whenever the store is used, as no
        timer is worth one per file)."""
        now = time.time()
        for stored in [f for f in self._files.values() if f.expires_at and f.expires_at <= now]:
            del self._files[stored.id]
            self.used -= len(stored.content)
