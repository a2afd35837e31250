"""How far float32 logits are from HF transformers' float64 ones, on the embedded SmolLM2.

Prefills a prompt, then decodes 16 greedy tokens (the float64 reference's picks) through the paged
KV cache, and prints the max and mean (over steps) of the max abs logit error for: HF's own
float32 run, and inflight's float32 model (quantization "none") with each CPU attention backend.

    .venv/bin/python bench/logit_error.py
"""

from __future__ import annotations

import copy

import torch

from inflight.bench.offline import hf_model
from inflight.bench.report import write_report
from inflight.model.attention import AttentionBackend, select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.contract import ModelCaches
from inflight.model.families.llama import LlamaForCausalLM
from inflight.model.metadata import KVCache
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

PROMPT = "The history of the Roman Empire begins"
STEPS = 16
BLOCK_SIZE = 16
CPU = torch.device("cpu")


def _last_logits(
    model: LlamaForCausalLM, backend: AttentionBackend, kv: list[KVCache], row: RowInput
) -> torch.Tensor:
    batch = build_ragged_batch([row], BLOCK_SIZE, CPU)
    backend.plan(batch.forward.attention)
    hidden = model(batch.forward, ModelCaches(kv, backend))
    return model.compute_logits(hidden[batch.logits_indices])[0].double()


def main() -> None:
    hf32 = hf_model(None)
    hf64 = copy.deepcopy(hf32).double()
    checkpoint = open_checkpoint()
    config = checkpoint.config
    model = build_model(checkpoint, torch.float32, CPU, 256, quantization="none")
    ids = checkpoint.tokenizer.encode(PROMPT)
    blocks = list(range(-(-(len(ids) + STEPS) // BLOCK_SIZE)))
    backends = {
        name: select_backend(name, CPU, torch.float32, config.head_dim) for name in ("torch", "cpu")
    }
    caches: dict[str, list[KVCache]] = {}
    for name, backend in backends.items():
        shape = backend.kv_cache_shape(
            len(blocks), BLOCK_SIZE, config.num_kv_heads, config.head_dim
        )
        caches[name] = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    errors: dict[str, list[float]] = {"hf-float32": [], **{f"inflight-{n}": [] for n in backends}}
    seq = list(ids)
    with torch.inference_mode():
        for step in range(STEPS + 1):
            tokens = torch.tensor([seq])
            ref = hf64(tokens, logits_to_keep=1).logits[0, -1]
            errors["hf-float32"].append(
                (hf32(tokens, logits_to_keep=1).logits[0, -1].double() - ref).abs().max().item()
            )
            row = (
                RowInput(seq, 0, blocks, True)
                if step == 0
                else RowInput(seq[-1:], len(seq) - 1, blocks, True)
            )
            for name, backend in backends.items():
                logits = _last_logits(model, backend, caches[name], row)
                errors[f"inflight-{name}"].append((logits - ref).abs().max().item())
            seq.append(int(ref.argmax()))
    summary = {k: {"max": max(v), "mean": sum(v) / len(v)} for k, v in errors.items()}
    for name, s in summary.items():
        print(f"{name:<16} max {s['max']:.2e}  mean {s['mean']:.2e}")
    write_report("bench/out/logit_error.json", prompt=PROMPT, steps=STEPS, errors=summary)


if __name__ == "__main__":
    main()
