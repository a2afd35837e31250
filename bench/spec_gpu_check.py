"""Speculative decoding on CUDA, checked on the device: tiny random Qwen3 target (the tests'
`tiny_models`, built here with transformers), greedy, 4 requests in one in-flight batch, plain
against prompt lookup, the target as its own draft model (every draft should be accepted) and a
random tiny Llama as draft model (nearly none should be). Prints how many outputs are identical
to plain decoding's and the drafters' counters.

    python3 bench/spec_gpu_check.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from inflight.protocol.deployment import (
    DeploymentOptions,  # noqa: E402
    SpeculativeConfig,  # noqa: E402
)
from inflight.protocol.request import GenerationRequest, SamplingParams  # noqa: E402
from inflight.runtime.runtime import Runtime  # noqa: E402

from tiny_models import make_tiny_model  # noqa: E402

PROMPTS = [[(7 * i + j) % 300 for j in range(30)] + [5, 6, 7, 8] * 3 for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def outputs(runtime: Runtime) -> list[tuple[int, ...]]:
    session = runtime.new_session()
    refs = {session.admit(GenerationRequest(p, PARAMS)).ref: i for i, p in enumerate(PROMPTS)}
    done: dict[int, tuple[int, ...]] = {}
    while session.residents():
        for ref, snapshot in session.step().finished.items():
            done[refs[ref]] = tuple(snapshot.token_ids)
    session.finish()
    return [done[i] for i in range(len(PROMPTS))]


def main() -> None:
    root = Path(tempfile.mkdtemp())
    for family in ("llama", "qwen3"):
        make_tiny_model(family, root / family)
    config = dict(max_batch_size=4, max_model_len=256, enable_context_reuse=False, device="cuda")
    want = outputs(Runtime(root / "qwen3", DeploymentOptions(**config)))
    drafters = {
        "prompt lookup": SpeculativeConfig(4, prompt_lookup_min=1),
        "draft = target": SpeculativeConfig(4, method="draft_model", model=str(root / "qwen3")),
        "draft = random llama": SpeculativeConfig(
            4, method="draft_model", model=str(root / "llama")
        ),
    }
    for name, spec in drafters.items():
        runtime = Runtime(root / "qwen3", DeploymentOptions(**config, speculative_config=spec))
        got = outputs(runtime)
        same = sum(a == b for a, b in zip(got, want, strict=True))
        print(f"{name}: {same}/{len(want)} identical, {runtime.speculator.snapshot()}", flush=True)


if __name__ == "__main__":
    main()
