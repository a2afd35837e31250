"""How far float32 logits are from HF transformers' float64 ones, on the embedded SmolLM2.

Prefills a prompt, then decodes 16 greedy tokens (the float64 reference's picks) through the paged
KV cache, and prints the max and mean (over steps) of the max abs logit error for: HF's own
float32 run, and inflight with each CPU attention backend.

    .venv/bin/python bench/logit_error.py
"""

from __future__ import annotations

import copy

import torch

from inflight.bench.offline import hf_model
from inflight.bench.report import write_report
from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import Runtime, RuntimeConfig

PROMPT = "The history of the Roman Empire begins"
STEPS = 16


def _last_logits(runtime: Runtime, row: RowInput) -> torch.Tensor:
    batch = build_ragged_batch([row], runtime.blocks.block_size, runtime.device)
    return runtime.runner.logits(runtime.runner.execute(batch))[0].double()


def main() -> None:
    hf32 = hf_model(None)
    hf64 = copy.deepcopy(hf32).double()
    runtimes = {
        name: Runtime(
            None, RuntimeConfig(max_batch_size=1, max_model_len=256, attention_backend=name)
        )
        for name in ("torch", "cpu")
    }
    ids = runtimes["cpu"].tokenizer.encode(PROMPT)
    blocks = {
        n: rt.blocks.allocate(rt.blocks.blocks_for(len(ids) + STEPS)) for n, rt in runtimes.items()
    }
    errors: dict[str, list[float]] = {"hf-float32": [], **{f"inflight-{n}": [] for n in runtimes}}
    seq = list(ids)
    with torch.no_grad():
        for step in range(STEPS + 1):
            tokens = torch.tensor([seq])
            ref = hf64(tokens, logits_to_keep=1).logits[0, -1]
            errors["hf-float32"].append(
                (hf32(tokens, logits_to_keep=1).logits[0, -1].double() - ref).abs().max().item()
            )
            for name, rt in runtimes.items():
                row = (
                    RowInput(seq, 0, blocks[name], True)
                    if step == 0
                    else RowInput(seq[-1:], len(seq) - 1, blocks[name], True)
                )
                errors[f"inflight-{name}"].append((_last_logits(rt, row) - ref).abs().max().item())
            seq.append(int(ref.argmax()))
    summary = {k: {"max": max(v), "mean": sum(v) / len(v)} for k, v in errors.items()}
    for name, s in summary.items():
        print(f"{name:<16} max {s['max']:.2e}  mean {s['mean']:.2e}")
    write_report("bench/out/logit_error.json", prompt=PROMPT, steps=STEPS, errors=summary)


if __name__ == "__main__":
    main()
