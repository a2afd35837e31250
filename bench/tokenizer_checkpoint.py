"""The embedded default model's tokenizer as a checkpoint directory small enough to carry to the
GPU machine (the 98 MB GGUF is not): `config.json` of the model's shape, `tokenizer.json` and
`tokenizer_config.json`, no weights. `bench/gpu_check.py`'s structured-outputs check reads it
through `$INFLIGHT_TOKENIZER`, so the whole check runs in one call there.

    .venv/bin/python bench/tokenizer_checkpoint.py bench/out/tokenizer
    INFLIGHT_TOKENIZER=bench/out/tokenizer python bench/gpu_check.py   # carry bench/out/tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inflight.model.checkpoints.loader import open_checkpoint

# Texts whose ids the written tokenizer must give as the GGUF's does.
SAMPLES = ("Hello, world!", '{"n": 42, "tag": "a"}', "north-south 12-abc\n\tüñïçødé ✓")


def write(out: Path) -> None:
    checkpoint = open_checkpoint(None)
    tokenizer, config = checkpoint.tokenizer, checkpoint.config
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    special = tokenizer.special
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": special.bos,
                "eos_token": special.eos,
                "chat_template": tokenizer.chat_template,
            }
        )
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_hidden_layers": config.num_layers,
                "num_attention_heads": config.num_heads,
                "num_key_value_heads": config.num_kv_heads,
                "rms_norm_eps": config.rms_norm_eps,
                "max_position_embeddings": config.max_position_embeddings,
                "rope_theta": config.rope.theta,
                "tie_word_embeddings": config.tie_word_embeddings,
                "eos_token_id": list(special.eos_ids),
            }
        )
    )
    written = open_checkpoint(out).tokenizer
    for text in SAMPLES:
        if written.encode(text) != tokenizer.encode(text):
            raise SystemExit(f"the written tokenizer encodes {text!r} otherwise")
    if (
        written.eos_token_ids != tokenizer.eos_token_ids
        or written.chat_template != tokenizer.chat_template
    ):
        raise SystemExit("the written tokenizer's end tokens or chat template differ")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e6:.1f} MB, encodes as the GGUF's tokenizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    write(parser.parse_args().out)


if __name__ == "__main__":
    main()
