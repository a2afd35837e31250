"""`inflight serve` as `make serve` starts it: a real process, driven over HTTP."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import free_port

INFLIGHT = str(Path(sys.executable).with_name("inflight"))


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [INFLIGHT, "serve", "--port", str(port), "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            output = process.stdout.read()
            pytest.fail(f"inflight serve exited with {process.returncode}:\n{output}")
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "inflight serve did not become ready"
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    return output


@pytest.mark.slow
def test_make_serve_command_line_serves_the_default_model():
    process, url = _start("--enable-in-flight-batching", "--enable-context-reuse")
    try:
        health = httpx.get(url + "/health").json()
        assert health["capabilities"]["in_flight_batching"] is True
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=health["model"],
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4
        assert httpx.get(url + "/health").json()["capabilities"]["context_reuse"] is True
    finally:
        output = _stop(process)
    assert "serving" in output and "context cache" in output


def test_a_bad_option_is_a_clear_error(tiny_dirs):
    result = subprocess.run(
        [INFLIGHT, "serve", tiny_dirs["llama"], "--max-batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "max-batch-size" in result.stderr


def test_defaults_are_auto_quantization_and_the_context_cache_on():
    from inflight.server.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.quantization == "auto" and args.enable_context_reuse is True
    args = parser.parse_args(["serve", "--no-enable-context-reuse", "--quantization", "none"])
    assert args.quantization == "none" and args.enable_context_reuse is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "q3"])
