"""`inflight serve` as `make serve` starts it: a real process, driven over HTTP."""

import contextlib
import os
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


def test_a_bad_option_is_a_clear_error(tiny_dirs):
    result = subprocess.run(
        [INFLIGHT, "serve", tiny_dirs["llama"], "--max-batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "max-batch-size" in result.stderr


def test_a_model_path_after_served_model_names_is_a_clear_error(tiny_dirs, capsys):
    """`--served-model-name` takes every word after it, as vLLM's does: a model path put there
    would serve the default model under the path's name; it is refused, naming the fix."""
    from inflight.server.cli import main

    assert main(["serve", "--served-model-name", "smol", str(tiny_dirs["llama"])]) == 2
    assert "give the model first" in capsys.readouterr().err


def test_defaults_are_auto_quantization_and_the_context_cache_on():
    from inflight.server.cli import build_parser, deployment_options

    parser = build_parser()
    args = parser.parse_args(["serve"])
    options = deployment_options(args)
    assert options.quantization == "auto" and options.enable_context_reuse is True
    assert options.kv_cache_dtype == "auto"
    assert args.host == "127.0.0.1"  # reachable from elsewhere only when --host says so
    assert args.shutdown_timeout == 30.0
    assert args.served_model_name is None
    named = parser.parse_args(["serve", "--served-model-name", "smol", "gpt-4.1"])
    assert named.served_model_name == ["smol", "gpt-4.1"]
    args = parser.parse_args(["serve", "--no-enable-context-reuse", "--quantization", "none"])
    options = deployment_options(args)
    assert options.quantization == "none" and options.enable_context_reuse is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "q3"])
    fp8 = deployment_options(parser.parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert fp8.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_every_command_takes_the_deployment_knobs_by_one_name_and_default(capsys):
    """`serve`, `chat` and `bench throughput` read the knobs of `DeploymentOptions` (the names
    `LLM` takes): a flag per knob, and a knob not given keeps the one default."""
    from dataclasses import fields

    from inflight.protocol.deployment import DeploymentOptions
    from inflight.server.cli import build_parser, deployment_options

    parser = build_parser()
    given = ["--max-model-len", "300", "--max-num-tokens", "64", "--max-batch-size", "4"]
    for command in (["serve"], ["chat", "hi"], ["bench", "throughput"]):
        options = deployment_options(parser.parse_args([*command, *given]))
        assert (options.max_model_len, options.max_num_tokens, options.max_batch_size) == (
            300,
            64,
            4,
        )
        assert deployment_options(parser.parse_args(command)) == DeploymentOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert all(f"--{f.name.replace('_', '-')}" in help_text for f in fields(DeploymentOptions))


def test_bench_throughput_runs_every_prompt_at_once_unless_told(monkeypatch, capsys):
    """As llama-server gets a slot per prompt, inflight's batch is --num-prompts unless
    --max-batch-size is given (the deployment default, 8, would run 16 prompts in two waves)."""
    import contextlib

    from inflight.bench import offline
    from inflight.server.cli import main

    batches = []

    @contextlib.contextmanager
    def open_inflight(model, work, batch, **knobs):
        batches.append(batch)
        yield lambda prompts: 1.0

    monkeypatch.setattr(offline, "load_tokenizer", lambda model: None)
    work = offline.Workload([[]], 1, [])
    monkeypatch.setattr(offline, "make_workload", lambda *args, rounds: work)
    monkeypatch.setattr(offline, "open_inflight", open_inflight)
    command = ["bench", "throughput", "--num-prompts", "16", "--engines", "inflight"]
    assert main(command) == 0
    assert main([*command, "--max-batch-size", "4"]) == 0
    assert batches == [16, 4]


def test_bench_throughput_alternates_the_open_engines_round_by_round(monkeypatch, capsys, tmp_path):
    """--rounds: every engine opened once and kept open, their timed passes alternated, each
    round on its own prompts; each engine's median and the median of the rounds' ratios (each
    round's engines measured seconds apart) are reported."""
    import contextlib
    import json

    from inflight.bench import offline
    from inflight.server.cli import main

    events = []
    speeds = {"inflight": iter([600.0, 500.0, 700.0]), "llama-server": iter([300.0, 200.0, 400.0])}

    def engine(name):
        @contextlib.contextmanager
        def open_engine(*args, **kwargs):
            events.append(("open", name))
            yield lambda prompts: events.append((name, prompts[0][0])) or next(speeds[name])
            events.append(("close", name))

        return open_engine

    work = offline.Workload([[[1]], [[2]], [[3]]], 1, [[0]])
    monkeypatch.setattr(offline, "load_tokenizer", lambda model: None)
    monkeypatch.setattr(offline, "make_workload", lambda *args, rounds: work)
    monkeypatch.setattr(offline, "open_inflight", engine("inflight"))
    monkeypatch.setattr(offline, "open_llama_server", engine("llama-server"))
    out = tmp_path / "out.json"
    command = ["bench", "throughput", "--engines", "llama-server", "inflight", "--rounds", "3"]
    assert main([*command, "--llama-server", "llama-server", "--out", str(out)]) == 0
    assert events == [
        ("open", "llama-server"), ("open", "inflight"),
        ("llama-server", 1), ("inflight", 1), ("llama-server", 2), ("inflight", 2),
        ("llama-server", 3), ("inflight", 3),
        ("close", "inflight"), ("close", "llama-server"),
    ]  # fmt: skip
    text = capsys.readouterr().out
    assert "round 2: llama-server 200.0, inflight 500.0 output tok/s" in text
    assert "inflight          600.0 output tok/s (median of 3 rounds, 500.0-700.0)" in text
    # ratios 2.0, 2.5, 1.75: their median, not the medians' ratio (600 / 300 = 2.0)
    assert "inflight / best peer: 2.00x (median of the rounds' ratios, 1.75-2.50)" in text
    report = json.loads(out.read_text())
    assert report["output_tok_s"] == {"llama-server": 300.0, "inflight": 600.0}
    assert [r["inflight"] for r in report["rounds"]] == [600.0, 500.0, 700.0]

    # One round: one engine open at a time, as before --rounds.
    events.clear()
    speeds = {"inflight": iter([600.0]), "llama-server": iter([300.0])}
    assert main([*command[:-1], "1", "--llama-server", "llama-server"]) == 0
    assert events == [
        ("open", "llama-server"), ("llama-server", 1), ("close", "llama-server"),
        ("open", "inflight"), ("inflight", 1), ("close", "inflight"),
    ]  # fmt: skip
    assert "inflight / best peer: 2.00x\n" in capsys.readouterr().out

    # Two inflight engines open at once would throttle each other's OpenMP workers.
    events.clear()
    assert main([*command[:3], "inflight", "inflight-q4", "--rounds", "2"]) == 2
    assert "one inflight engine at a time; got inflight, inflight-q4" in capsys.readouterr().err
    assert events == []


@pytest.mark.slow
def test_make_serve_command_line_serves_then_drains_on_sigterm():
    """`make serve`'s command line serves the default model under in-flight batching with the
    context cache (one server process for both parts of this test). Then SIGTERM: new requests
    get 503 with Retry-After and readiness fails at once; a request that finishes within
    --shutdown-timeout completes; streams still running then are cancelled with an error event
    naming the shutdown; the process exits 0. Every request has an outcome."""
    import threading

    process, url = _start(
        "--enable-in-flight-batching", "--enable-context-reuse", "--shutdown-timeout", "3"
    )
    health = httpx.get(url + "/health").json()
    assert health["capabilities"]["in_flight_batching"] is True
    assert health["capabilities"]["context_reuse"] is True
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=health["model"],
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4
    long_body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    long_body["ignore_eos"] = True
    streams: list[list[str]] = [[], []]

    def read(lines: list[str]) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=long_body, timeout=120) as r:
            lines.extend(line for line in r.iter_lines() if line)

    readers = [threading.Thread(target=read, args=(lines,)) for lines in streams]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 60
        while not all(streams):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        short: list[httpx.Response] = []
        body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        finisher = threading.Thread(
            target=lambda: short.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        )
        submitted = httpx.get(url + "/health").json()["scheduling"]["submitted"]
        finisher.start()
        while httpx.get(url + "/health").json()["scheduling"]["submitted"] == submitted:
            assert time.monotonic() < deadline, "the short request was not accepted"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health/ready").status_code != 503:
            assert time.monotonic() < deadline, "readiness did not fail after SIGTERM"
            time.sleep(0.02)
        assert httpx.get(url + "/health/ready").json()["status"] == "shutting_down"
        refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert "shutting down" in refused.json()["error"]["message"]
        finisher.join(timeout=60)
        assert short[0].status_code == 200
        assert short[0].json()["usage"]["completion_tokens"] == 8
        for reader in readers:
            reader.join(timeout=60)
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            assert "cancelled before it finished: the server is shutting down" in lines[-2]
        assert process.wait(timeout=30) == 0
        output = process.stdout.read()
        assert "serving" in output and "context cache" in output
    finally:
        if process.poll() is None:
            process.kill()


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing workers a process spawned (not its resource tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            children.append(int(entry.name))
    return children


@pytest.mark.slow
def test_tensor_parallel_server_serves_and_exits_1_when_a_rank_dies(tiny_dirs):
    """Two ranks behind the server: the openai client gets the single-rank answer; a killed
    worker makes `/health/ready` fail and the server exit 1 instead of hanging."""
    from inflight import LLM, SamplingParams

    process, url = _start(
        str(tiny_dirs["llama"]), "--enable-in-flight-batching", "--tensor-parallel-size", "2"
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = httpx.get(url + "/health").json()["model"]
        reply = client.completions.create(
            model=model, prompt="The quick brown fox", max_tokens=12, temperature=0
        )
        with LLM(tiny_dirs["llama"]) as single:
            params = SamplingParams(max_tokens=12, temperature=0)
            expected = single.generate("The quick brown fox", params)
        assert reply.choices[0].text == expected[0].text
        (worker,) = _spawned_children(process.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        states = set()
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                states.add(httpx.get(url + "/health/ready", timeout=1).status_code)
            time.sleep(0.05)
        assert process.wait(timeout=30) == 1
        assert 503 in states
        assert "tensor-parallel rank 1 exited" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
