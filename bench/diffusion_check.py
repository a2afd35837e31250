"""Block diffusion on a device against transformers on the same device: the tests' tiny random
DiffusionGemma (with its vision tower) in float32, seeded requests alone, several at once and
with an image, ours token for token against `generate()` (both draw from the device's
generators in the same order). Prints each case and writes JSON.

    python bench/diffusion_check.py --device cuda          # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from inflight import LLM  # noqa: E402
from inflight.bench.report import report_path, write_report  # noqa: E402
from inflight.protocol.request import DiffusionParams, SamplingParams  # noqa: E402

from diffusion_reference import CANVAS, write_tiny_checkpoint  # noqa: E402

STEPS = 6
PROMPTS = [list(range(5, 15)), list(range(40, 62)), [9, 3, 77, 120, 5]]


def reference_tokens(model, ids, seed, device, **media) -> list[int]:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=3 * CANVAS,
            max_denoising_steps=STEPS,
            eos_token_id=None,
            **media,
        )
    return out.sequences[0, len(ids) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        reference = write_tiny_checkpoint(path).to(device)
        (path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 70}))
        llm = LLM(
            str(path),
            enable_in_flight_batching=True,
            device=device.type,
            dtype="float32",
            max_model_len=256,
            max_num_tokens=64,
        )
        diffusion = DiffusionParams(max_denoising_steps=STEPS)
        # transformers' rows run without an EOS (eos_token_id=None): ours ignore it.
        params = [
            SamplingParams(max_tokens=3 * CANVAS, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        wanted = [reference_tokens(reference, p, i, device) for i, p in enumerate(PROMPTS)]
        alone = [
            list(llm.generate(p, q, diffusion=diffusion)[0].outputs[0].token_ids)
            for p, q in zip(prompts, params, strict=True)
        ]
        together = [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, diffusion=diffusion)
        ]
        cases["alone"] = alone == wanted
        cases["together"] = together == wanted
        picture = Image.fromarray(
            np.random.default_rng(0).integers(0, 256, (100, 90, 3), dtype=np.uint8)
        )
        processed = Gemma4ImageProcessorPil(max_soft_tokens=70)([picture], return_tensors="pt")
        config = reference.config
        n = int(processed["num_soft_tokens_per_image"][0])
        ids = [5, 6, config.boi_token_id, *[config.image_token_id] * n, config.eoi_token_id, 8]
        want = reference_tokens(
            reference,
            ids,
            7,
            device,
            pixel_values=processed["pixel_values"].to(device),
            image_position_ids=processed["image_position_ids"].to(device),
        )
        image_prompt = {
            "prompt_token_ids": [5, 6, config.image_token_id, 8],
            "multi_modal_data": {"image": picture},
        }
        (out,) = llm.generate(
            image_prompt,
            SamplingParams(max_tokens=3 * CANVAS, seed=7, ignore_eos=True),
            diffusion=diffusion,
        )
        cases["image"] = list(out.outputs[0].token_ids) == want
        llm.close()
    for name, equal in cases.items():
        print(f"{name}: {'equal' if equal else 'DIFFERENT'}")
    write_report(
        report_path(f"diffusion_check_{device.type}.json"),
        command=" ".join(sys.argv),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        cases=cases,
    )


if __name__ == "__main__":
    main()
