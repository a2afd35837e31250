"""A tiny random DiffusionGemma (transformers' `DiffusionGemmaForBlockDiffusion`) for the
tests: its config, the model with seeded weights, the checkpoint written with a tokenizer, and
transformers' `generate()` of a prompt under a seed."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # the test tokenizer's 300 tokens fit
CANVAS = 8
EOS = 2  # <|im_end|> of the test tokenizer


def config_dict(vocab: int = VOCAB, canvas: int = CANVAS, layers: int = 4) -> dict:
    """Three sliding layers (window 16) and a full one; MoE of 4 experts, top 2."""
    kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    text = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=16,
        layer_types=kinds,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=0,
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    return dict(
        text_config=text,
        vision_config=vision,
        canvas_length=canvas,
        image_token_id=vocab - 1,
        boi_token_id=vocab - 2,
        eoi_token_id=vocab - 3,
    )


def tiny_model(seed: int = 0, spread: float = 0.0, config: dict | None = None):
    """The reference model (float32, eval) with seeded weights, of `config` (None:
    `config_dict()`); `spread` > 0 redraws its matrices with that deviation."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    config = config or config_dict()
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**config)).eval()
    if spread:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, spread)
    return model


def write_tiny_checkpoint(
    path: Path, seed: int = 0, spread: float = 0.0, config: dict | None = None
):
    """The tiny model written to `path` with the test tokenizer; returns the model."""
    from tiny_models import write_tokenizer

    model = tiny_model(seed, spread, config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return model


def reference_generate(model, prompt: list[int], seed: int, **gen) -> list[int]:
    """transformers' new tokens for `prompt` with torch's generator seeded `seed` (up to the
    EOS, where one ends it: the pads after it left out)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), **gen)
    new = out.sequences[0, len(prompt) :].tolist()
    eos = gen.get("eos_token_id", EOS)
    return new[: new.index(eos) + 1] if eos in new else new
