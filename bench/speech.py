"""Text to speech under load: time to first audio and real-time factor at 1, 4 and 16
concurrent requests, inflight against the reference package (`qwen-tts-compat`) run the same way.

A random-weight Qwen3-TTS (custom voice) is written in the published layout: `--shape tiny`
(the tests' model) or `--shape 0.6b`, the 0.6B models' shape as third-party copies of their
configs give it (talker: the Qwen3-0.6B decoder, 28 layers of 1024; code predictor: 5 such
layers; 16 codebooks of 2048; decoder: 8 layers of 512, window 72, 1536 channels upsampled
1920x). Each request speaks the same sentence for `--frames` frames (12.5 a second) with the
package's sampling (temperature 0.9, top-k 50, repetition penalty 1.05), never ending early
(inflight: `ignore_eos`; the reference: its end code masked with the other tags, its end id
moved past the vocabulary), so that every request makes `--frames` frames.

inflight: `concurrency` requests submitted at once to one LLM (in-flight batching), each
streamed; time to first audio is submit to the first chunk with samples, RTF is a request's
wall time over its audio's duration. The reference: one `generate` over the batch of
`concurrency` texts (its batching: left-padded, static), then `chunked_decode` per request:
its first audio is its whole audio.

    .venv/bin/python bench/speech.py --shape tiny --frames 100
    python bench/speech.py --shape 0.6b --device cuda        # on the GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from inflight import LLM  # noqa: E402
from inflight.bench.phases import time_phases  # noqa: E402
from inflight.bench.report import report_path, write_report  # noqa: E402
from inflight.protocol.request import SamplingParams  # noqa: E402

from speech_reference import TINY, Shape, write_tiny_checkpoint  # noqa: E402

_LAYER_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000,
    "pad_token_id": None,
}
SHAPES = {
    "tiny": TINY,
    "0.6b": Shape(
        talker=_LAYER_06B,
        predictor={**_LAYER_06B, "num_hidden_layers": 5},
        codebook=2048,
        groups=16,
        text_vocab=151936,
        text_hidden=2048,
        decoder={
            "codebook_size": 2048,
            "codebook_dim": 512,
            "hidden_size": 512,
            "latent_dim": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 64,
            "intermediate_size": 1024,
            "num_hidden_layers": 8,
            "num_quantizers": 16,
            "decoder_dim": 1536,
            "sliding_window": 72,
        },
    ),
}
TEXT = "In-flight batching admits new requests into a batch that is already generating."
FRAME_SECONDS = 1920 / 24000


def run_inflight(llm: LLM, concurrency: int, frames: int) -> dict:
    first, total, made = [0.0] * concurrency, [0.0] * concurrency, [0] * concurrency
    start = threading.Barrier(concurrency)

    def one(i: int) -> None:
        params = SamplingParams(
            temperature=0.9,
            top_k=50,
            repetition_penalty=1.05,
            max_tokens=frames,
            seed=i,
            ignore_eos=True,
        )
        start.wait()
        t0 = time.perf_counter()
        for chunk in llm.speech_stream(TEXT, params, voice="vivian"):
            if chunk.audio and not first[i]:
                first[i] = time.perf_counter() - t0
            made[i] += len(chunk.codes)
        total[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    wall = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall
    return summary(first, total, made, wall)


PHASES = ("_forward", "_first_codes", "_frames", "_audio")


def profiled(device: torch.device) -> dict[str, list[float]]:
    """The talker loop's step phases timed (synchronized on CUDA)."""
    from inflight.runtime.speech.talker_loop import TalkerLoop

    return time_phases(TalkerLoop, PHASES, device)


def summary(first: list[float], total: list[float], made: list[int], wall: float) -> dict:
    rtf = [t / (n * FRAME_SECONDS) for t, n in zip(total, made, strict=True) if n]
    return {
        "ttfa_ms_mean": 1000 * statistics.mean(first),
        "ttfa_ms_max": 1000 * max(first),
        "rtf_mean": statistics.mean(rtf),
        "frames": sum(made),
        "audio_seconds_per_second": sum(made) * FRAME_SECONDS / wall,
    }


def run_reference(model, decoder, ids: torch.Tensor, concurrency: int, frames: int) -> dict:
    device = next(model.parameters()).device
    talker = model.config.talker_config
    talker.codec_eos_token_id = talker.vocab_size + 1  # nothing ends it: --frames frames
    t0 = time.perf_counter()
    with torch.no_grad():
        codes, _ = model.generate(
            input_ids=[ids.to(device)] * concurrency,
            languages=["auto"] * concurrency,
            speakers=["vivian"] * concurrency,
            max_new_tokens=frames + 1,
            do_sample=True,
            top_k=50,
            temperature=0.9,
            repetition_penalty=1.05,
            eos_token_id=talker.codec_eos_token_id,
        )
        for c in codes:
            decoder.chunked_decode(c.T[None].to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    made = [len(c) for c in codes]
    return summary([wall] * concurrency, [wall] * concurrency, made, wall)


def graph_check(path: Path, options: dict) -> dict:
    """Whether the CUDA graphs (the talker's decode steps, the code predictor's loop) give the
    eager steps' frames, greedy and seeded-sampled, one request alone."""
    requests = {
        "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        "sampled": SamplingParams(
            temperature=0.9, top_k=50, seed=1, max_tokens=40, ignore_eos=True
        ),
    }
    codes = {}
    for graphs in (True, False):
        with LLM(str(path), max_model_len=512, cuda_graphs=graphs, **options) as llm:
            codes[graphs] = {
                name: llm.speech(TEXT, p, voice="vivian", subtalker_sample=name != "greedy").codes
                for name, p in requests.items()
            }
    return {
        "graphs_equal_eager": {name: codes[True][name] == codes[False][name] for name in requests}
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--frames", type=int, default=125)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="time the step's phases (synchronizing)"
    )
    parser.add_argument(
        "--check-graphs", action="store_true", help="CUDA graphs against eager, frame for frame"
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tts"
        model, decoder = write_tiny_checkpoint(path, "custom_voice", seed=0, shape=shape)
        options = {"device": args.device, "dtype": args.dtype}
        options = {k: v for k, v in options.items() if v is not None}
        check = graph_check(path, options) if args.check_graphs else {}
        print(check, flush=True)
        llm = LLM(
            str(path),
            enable_in_flight_batching=True,
            max_batch_size=max(args.concurrency),
            max_model_len=args.frames + 256,
            **options,
        )
        ids = torch.tensor([llm.prepare_speech(TEXT, voice="vivian").prompt_token_ids])
        times = profiled(llm._live().device) if args.profile else None
        for c in args.concurrency:
            run_inflight(llm, c, 8)  # warm-up at this batch (kernels compiled for its shapes)
            if times is not None:
                for phase in times.values():
                    phase.clear()
            row = {"engine": "inflight", "concurrency": c, **run_inflight(llm, c, args.frames)}
            if times is not None:
                row["phase_ms_mean"] = {
                    name: 1000 * statistics.mean(t) for name, t in times.items() if t
                }
                row["phase_calls"] = {name: len(t) for name, t in times.items()}
            print(row, flush=True)
            results.append(row)
        llm.close()
        if not args.no_reference:
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = getattr(torch, args.dtype) if args.dtype else None
            if dtype is None:
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model, decoder = model.to(device, dtype), decoder.to(device, dtype)
            run_reference(model, decoder, ids, 1, 4)  # warm-up
            for c in args.concurrency:
                row = {
                    "engine": "reference",
                    "concurrency": c,
                    **run_reference(model, decoder, ids, c, args.frames),
                }
                print(row, flush=True)
                results.append(row)
    write_report(
        report_path(f"speech_{args.shape}.json"),
        shape=args.shape,
        frames=args.frames,
        device=args.device or "auto",
        **check,
        results=results,
    )


if __name__ == "__main__":
    main()
