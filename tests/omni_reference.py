"""A tiny random Qwen3-Omni bundle (thinker, talker, code predictor, Code2Wav) written as a real
checkpoint directory, and transformers' `Qwen3OmniMoeForConditionalGeneration` as the reference.

The tiny tokenizer (tiny_models.write_tokenizer) holds the bundle's special tokens as tokens of
their own, so a chat template's `<|im_start|>user` is the two ids the talker's prompt reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL = (
    "user",
    "assistant",
    "system",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|vision_start|>",
)
# Their ids: after tiny_models.SPECIAL's three (<|endoftext|>, <|im_start|>, <|im_end|>).
IDS = {name: 3 + i for i, name in enumerate(SPECIAL)}
IM_START, IM_END = 1, 2
VOCAB = 320  # the thinker's (the tokenizer's 300 and room)
CODEBOOK = 64
GROUPS = 4
_MROPE = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "mrope_section": [4, 2, 2],
    "interleaved": True,
}


def voices(codebook: int = CODEBOOK) -> dict[str, int]:
    """The voices' codec rows (in the talker's top 1024, past the codebook)."""
    return {"ethan": codebook + 254, "chelsie": codebook + 253}


def config_dict(codebook: int = CODEBOOK, groups: int = GROUPS) -> dict:
    """The tiny bundle's config (as `Qwen3OmniMoeConfig` takes it); `codebook` and `groups`:
    its codec's (a bench widens the rest)."""
    return dict(
        thinker_config=dict(
            audio_config=dict(
                d_model=32,
                encoder_attention_heads=4,
                encoder_ffn_dim=32,
                encoder_layers=1,
                num_mel_bins=20,
                downsample_hidden_size=16,
                output_dim=64,
                n_window=50,
                n_window_infer=100,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                out_hidden_size=64,
                intermediate_size=32,
                num_heads=4,
                patch_size=16,
                spatial_merge_size=1,
                temporal_patch_size=2,
                deepstack_visual_indexes=[0],
            ),
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                rope_parameters=_MROPE,
                max_position_embeddings=1024,
            ),
            audio_token_id=IDS["<|audio_pad|>"],
            image_token_id=IDS["<|image_pad|>"],
            video_token_id=IDS["<|video_pad|>"],
            audio_start_token_id=IDS["<|audio_start|>"],
            vision_start_token_id=IDS["<|vision_start|>"],
            user_token_id=IDS["user"],
        ),
        talker_config=dict(
            text_config=dict(
                vocab_size=codebook + 1024,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                moe_intermediate_size=16,
                num_experts=4,
                num_experts_per_tok=2,
                shared_expert_intermediate_size=32,
                rope_parameters={**_MROPE, "mrope_section": [2, 1, 1]},
                max_position_embeddings=2048,
            ),
            code_predictor_config=dict(
                vocab_size=codebook,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                num_code_groups=groups,
            ),
            num_code_groups=groups,
            thinker_hidden_size=64,
            accept_hidden_layer=2,
            spatial_merge_size=1,
            codec_pad_id=codebook + 100,
            codec_bos_id=codebook + 101,
            codec_eos_token_id=codebook + 102,
            codec_nothink_id=codebook + 107,
            codec_think_bos_id=codebook + 108,
            codec_think_eos_id=codebook + 109,
            speaker_id=voices(codebook),
            audio_token_id=IDS["<|audio_pad|>"],
            image_token_id=IDS["<|image_pad|>"],
            video_token_id=IDS["<|video_pad|>"],
            audio_start_token_id=IDS["<|audio_start|>"],
            vision_start_token_id=IDS["<|vision_start|>"],
        ),
        code2wav_config=dict(
            codebook_size=codebook,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=64,
            num_hidden_layers=1,
            num_quantizers=groups,
            decoder_dim=32,
            upsample_rates=[8, 5, 4, 3],
            upsampling_ratios=[2, 2],
            sliding_window=72,
        ),
        im_start_token_id=IM_START,
        im_end_token_id=IM_END,
        user_token_id=IDS["user"],
        assistant_token_id=IDS["assistant"],
        system_token_id=IDS["system"],
        tts_pad_token_id=IDS["<|tts_pad|>"],
        tts_bos_token_id=IDS["<|tts_bos|>"],
        tts_eos_token_id=IDS["<|tts_eos|>"],
    )


def tiny_model(seed: int = 0):
    """The reference bundle with seeded random weights (float32, eval): matrices drawn wide
    enough that greedy picks are clear-cut, Code2Wav's scaled as its real weights are (its
    default init gives ~1e-8 of amplitude)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**config_dict())
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            if name.startswith("code2wav."):
                p.mul_(5)
            elif ".audio_tower." not in name and ".visual." not in name:
                p.normal_(0.0, 0.2)
    return model


def write_tiny_checkpoint(path: Path, seed: int = 0):
    """The tiny bundle written to `path` (config.json, model.safetensors, the tokenizer);
    returns the reference model."""
    from tiny_models import write_tokenizer

    model = tiny_model(seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, SPECIAL)
    return model


def reference_reply(
    model, prompt: list[int], eos: int, max_tokens: int, frames: int, media: dict | None = None
):
    """transformers' greedy spoken reply to `prompt` (thinker and talker greedy, the thinker
    ending on `eos`; `media`: its media arguments, see `media_arguments`): the reply's tokens,
    its codec frames [(codes...), ...] and waveform. transformers' talker makes `frames` frames
    where it may generate `frames + 1` tokens (the last token's frame is never completed)."""
    captured = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            sequences, wav = model.generate(
                torch.tensor([prompt]),
                speaker="Ethan",
                thinker_max_new_tokens=max_tokens,
                thinker_eos_token_id=eos,
                talker_max_new_tokens=frames + 1,
                talker_do_sample=False,
                thinker_do_sample=False,
                **(media or {}),
            )
    finally:
        model.code2wav.chunked_decode = decode
    codes = [tuple(frame) for frame in captured["codes"][0].T.tolist()]
    return sequences[0, len(prompt) :].tolist(), codes, wav.reshape(-1).numpy()


def media_arguments(media) -> dict:
    """transformers' arguments for a request's media items (images, then clips, as prepared
    by our preparers)."""
    images = [m for m in media if m.kind == "image"]
    clips = [m for m in media if m.kind == "audio"]
    arguments = {}
    if images:
        arguments["pixel_values"] = torch.cat([torch.from_numpy(m.data[0]) for m in images])
        arguments["image_grid_thw"] = torch.tensor([m.data[1] for m in images])
    if clips:
        longest = max(m.data.shape[1] for m in clips)
        features = torch.zeros(len(clips), clips[0].data.shape[0], longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long)
        for i, m in enumerate(clips):
            features[i, :, : m.data.shape[1]] = torch.from_numpy(m.data)
            mask[i, : m.data.shape[1]] = 1
        arguments["input_features"], arguments["feature_attention_mask"] = features, mask
    return arguments


def greedy_thinker(model, prompt: list[int], max_tokens: int, media: dict | None = None):
    """The thinker's greedy tokens after `prompt`, without an end token."""
    with torch.no_grad():
        out = model.thinker.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, **(media or {})
        )
    return out[0, len(prompt) :].tolist()
