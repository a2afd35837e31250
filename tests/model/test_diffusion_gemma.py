"""DiffusionGemma's two passes against transformers' modules on a tiny random checkpoint: the
encoder's KV (written in chunks) read by a denoising step, with and without
self-conditioning, past the sliding window; and a batch of mixed segments of several sequences
giving each what it gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.families.diffusion_gemma import CanvasBatch

from diffusion_reference import CANVAS, write_tiny_checkpoint

PROMPT = list(range(5, 27))  # 22 tokens: past the window of 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    reference = write_tiny_checkpoint(path, spread=0.2)
    checkpoint = open_checkpoint(path)
    model = build_model(checkpoint, torch.float32, torch.device("cpu"), 512)
    return reference, model


def batch(segments, soft=None):
    """CanvasBatch of (ids, start, denoise, past slots, write slots) segments, the sliding
    layers' slots the full layers' (caches of one size)."""
    writes = [w for *_, denoise, _, w in segments if not denoise]
    write_slots = torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *writes]))
    past = [past for *_, past, _ in segments]
    return CanvasBatch(
        ids=torch.tensor([t for ids, *_ in segments for t in ids]),
        soft=soft,
        write_slots=write_slots,
        window_write_slots=write_slots,
        query_lens=[len(ids) for ids, *_ in segments],
        starts=[start for _, start, *_ in segments],
        denoise=[denoise for _, _, denoise, *_ in segments],
        past_slots=past,
        window_past_slots=past,
    )


def encode(model, caches, ids, start, base=0):
    slots = np.arange(base, base + start + len(ids))
    model(batch([(ids, start, False, slots[:start], slots[start:])]), caches)


def denoise(model, caches, canvas, start, soft=None, base=0):
    past = np.arange(base, base + start)
    soft = torch.zeros(len(canvas), model.config.hidden_size) if soft is None else soft
    hidden = model(batch([(canvas, start, True, past, None)], soft), caches)
    return model.compute_logits(hidden)


def test_the_config_reads_the_layer_kinds_and_defaults(models):
    _, model = models
    config = model.config
    assert config.layer_windows == (16, 16, 16, None)
    d = config.diffusion
    assert (d.canvas_length, d.global_head_dim, d.global_kv_heads) == (CANVAS, 32, 2)
    assert d.global_rotary_fraction == 0.25 and d.logit_softcap == 30.0
    assert (d.defaults.max_denoising_steps, d.defaults.t_min, d.defaults.t_max) == (48, 0.4, 0.8)


@torch.no_grad()
def test_encode_in_chunks_then_denoise_matches_transformers(models):
    from transformers import DynamicCache

    reference, model = models
    caches = model.allocate_kv(128, 128, torch.float32, torch.device("cpu"))
    cache = DynamicCache(config=reference.config.get_text_config())
    encode(model, caches, PROMPT[:13], 0)
    encode(model, caches, PROMPT[13:], 13)
    n = len(PROMPT)
    reference.model.encoder(
        input_ids=torch.tensor([PROMPT]), cache=cache, position_ids=torch.arange(n)[None]
    )
    torch.manual_seed(0)
    canvas = torch.randint(0, 320, (CANVAS,))
    positions = torch.arange(n, n + CANVAS)[None]
    want = reference(decoder_input_ids=canvas[None], cache=cache, decoder_position_ids=positions)
    got = denoise(model, caches, canvas.tolist(), n)
    torch.testing.assert_close(got, want.logits[0], atol=5e-5, rtol=0)
    # Self-conditioned on the previous step's (temperature-scaled) logits.
    scaled = want.logits[0] / 0.7
    want = reference(
        decoder_input_ids=canvas[None],
        self_conditioning_logits=scaled[None],
        cache=cache,
        decoder_position_ids=positions,
    )
    got = denoise(model, caches, canvas.tolist(), n, model.soft_embedding(scaled))
    torch.testing.assert_close(got, want.logits[0], atol=5e-5, rtol=0)
    # The canvas's argmax encoded, and the next canvas read over it (the sliding layers see
    # the last 15 positions only).
    block = want.logits[0].argmax(-1)
    encode(model, caches, block.tolist(), n)
    reference.model.encoder(input_ids=block[None], cache=cache, position_ids=positions)
    assert cache.get_seq_length() == n + CANVAS
    canvas = torch.randint(0, 320, (CANVAS,))
    positions = positions + CANVAS
    want = reference(decoder_input_ids=canvas[None], cache=cache, decoder_position_ids=positions)
    got = denoise(model, caches, canvas.tolist(), n + CANVAS)
    torch.testing.assert_close(got, want.logits[0], atol=5e-5, rtol=0)


@torch.no_grad()
def test_mixed_segments_of_several_sequences_give_each_what_it_gives_alone(models):
    _, model = models
    hidden = model.config.hidden_size
    alone = model.allocate_kv(256, 256, torch.float32, torch.device("cpu"))
    # Sequence A (slots 0..): its prompt encoded; sequence B (slots 128..): a prompt of 5.
    encode(model, alone, PROMPT, 0)
    canvas_a = list(range(40, 48))
    soft = torch.randn(CANVAS, hidden)
    want_a = denoise(model, alone, canvas_a, len(PROMPT), soft)
    encode(model, alone, [7, 8, 9, 10, 11], 0, base=128)
    canvas_b = list(range(60, 68))
    want_b = denoise(model, alone, canvas_b, 5, base=128)

    mixed = model.allocate_kv(256, 256, torch.float32, torch.device("cpu"))
    encode(model, mixed, PROMPT, 0)
    # One forward: A's canvas step, then B's whole prompt with its first canvas beside it.
    slots_b = np.arange(128, 133)
    segments = [
        (canvas_a, len(PROMPT), True, np.arange(len(PROMPT)), None),
        ([7, 8, 9, 10, 11], 0, False, slots_b[:0], slots_b),
        (canvas_b, 5, True, slots_b, None),
    ]
    both = torch.cat([soft, torch.zeros(CANVAS, hidden)])
    got = model.compute_logits(model(batch(segments, both), mixed))
    torch.testing.assert_close(got[:CANVAS], want_a, atol=2e-5, rtol=0)
    torch.testing.assert_close(got[CANVAS:], want_b, atol=2e-5, rtol=0)
    for (k1, v1), (k2, v2) in zip(alone, mixed, strict=True):
        torch.testing.assert_close(k1[128:133], k2[128:133], atol=2e-5, rtol=0)
        torch.testing.assert_close(v1[128:133], v2[128:133], atol=2e-5, rtol=0)
