"""The model families, a module each; importing this package registers them all (see
`registry.py`). Adding a family is adding its module and its line here."""

from inflight.model.families import (  # noqa: F401 (imported to register)
    diffusion_gemma,
    gpt_oss,
    hybrid,
    llama,
    llava,
    mixtral,
    qwen2_vl,
    qwen3_omni,
    qwen3_tts,
    qwen_moe,
    voxtral,
)
