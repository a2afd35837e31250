"""Native kernels compiled from source on first use, each shared object cached on disk.

The cache is `$XDG_CACHE_HOME/inflight` (default `~/.cache/inflight`); a library's name carries
a digest of its source, the local headers it includes and the flags, so that an edit or other
flags build anew.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


class KernelBuildError(RuntimeError):
    """A kernel's source could not be compiled here (no compiler, a failed compile)."""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "inflight"


def cached_library(source: Path, compiler: str, flags: tuple[str, ...], what: str) -> Path:
    """The shared object `compiler` (a command on PATH, or a path) builds from `source` with
    `flags` (and `-o`), built now unless cached; KernelBuildError when the compiler is missing
    or fails."""
    text = source.read_bytes()
    for header in re.findall(rb'^#include "([^"]+)"', text, re.MULTILINE):
        text += (source.parent / header.decode()).read_bytes()
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    command = shutil.which(compiler)
    if command is None:
        raise KernelBuildError(f"building {what} needs {compiler}; none found")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes each build their own copy
    # and the rename makes whichever lands last the (identical) cached file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [command, *flags, str(source), "-o", tmp], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise KernelBuildError(f"building {source.name} failed:\n{result.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
