"""Spoken chat replies under load (Qwen3-Omni): time to first audio and real-time factor at 1, 4
and 16 concurrent audio chats, and the text throughput of a batch with and without spoken
replies beside it.

A random-weight Qwen3-Omni bundle is written in the published layout: `--shape tiny` (the
tests' bundle) or `--shape wide`, the widths of Qwen3-Omni-30B-A3B as this repository's notes
give them (thinker: 2048 wide, 32 query and 4 KV heads of 128, experts of 768, 8 a token, vocab
152,064; talker: 1024 wide, 16 and 2 heads of 128, experts of 384, 6 a token, a shared expert
of 768, codec vocabulary 3,072; code predictor: 5 dense layers of 1024; 16 codebooks of 2,048;
Code2Wav: 8 layers of 1024, 1,536 channels upsampled 1920x), but fewer thinker layers (6 of 48)
and experts (16 of 128 in both decoders), so that it builds in a minute: what it measures is
the talker side at its real size, beside a thinker of the real width. Its weights are
transformers' initialisation.

Audio chats: each request is a one-turn chat whose reply is `--reply-tokens` tokens (the
thinker samples and never stops early) spoken in the voice "ethan" with the model's sampling
(temperature 0.9, top-k 50, repetition penalty 1.05), at most `--frames` frames; a random
talker may end a reply early, so the real-time factor is each request's wall time over the
audio it made. Time to first audio is submit to the first chunk with samples. Text beside
speech: `--text` text requests of `--reply-tokens` tokens alone, then with `--beside` spoken
replies submitted with them (`--text-tokens` tokens each, the spoken replies' voices at most
`--frames` frames); their output tokens over the time until the last ends.

    .venv/bin/python bench/omni.py --shape tiny
    python bench/omni.py --shape wide --device cuda           # on the GPU machine
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
from inflight.protocol.request import AudioReply, SamplingParams  # noqa: E402
from inflight.runtime.speech.talker_loop import TalkerLoop  # noqa: E402

from omni_reference import IDS, config_dict  # noqa: E402
from tiny_models import write_tokenizer  # noqa: E402

SAMPLE_RATE = 24000
PHASES = ("_forward", "_first_codes", "_frames", "_audio")
MESSAGES = [{"role": "user", "content": "Tell me about in-flight batching, briefly."}]


def _layers(hidden, heads, kv_heads, experts, top_k, moe, layers, **extra):
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe,
        num_hidden_layers=layers,
        **extra,
    )


def wide_config() -> dict:
    config = config_dict(codebook=2048, groups=16)
    thinker, talker = config["thinker_config"], config["talker_config"]
    thinker["text_config"].update(
        _layers(2048, 32, 4, 16, 8, 768, 6, vocab_size=152064, intermediate_size=6144)
    )
    thinker["text_config"]["rope_parameters"]["mrope_section"] = [24, 20, 20]
    for encoder in ("audio_config", "vision_config"):
        thinker[encoder]["output_dim" if encoder == "audio_config" else "out_hidden_size"] = 2048
    talker["text_config"].update(
        _layers(
            1024, 16, 2, 16, 6, 384, 20, intermediate_size=2048,
            shared_expert_intermediate_size=768,
        )
    )  # fmt: skip
    talker["text_config"]["rope_parameters"]["mrope_section"] = [24, 20, 20]
    talker["code_predictor_config"].update(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128,
    )  # fmt: skip
    talker.update(thinker_hidden_size=2048, accept_hidden_layer=4)
    config["code2wav_config"].update(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, decoder_dim=1536,
    )  # fmt: skip
    return config


def write_checkpoint(path: Path, shape: str) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    if shape == "tiny":
        from omni_reference import write_tiny_checkpoint

        write_tiny_checkpoint(path)
        return
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**wide_config()))
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, tuple(name for name in IDS))


def audio_chats(llm: LLM, concurrency: int, tokens: int, frames: int) -> dict:
    first, total, samples = [0.0] * concurrency, [0.0] * concurrency, [0] * concurrency
    start = threading.Barrier(concurrency)
    requests = [
        llm.prepare(
            MESSAGES,
            SamplingParams(temperature=0.9, max_tokens=tokens, ignore_eos=True, seed=i),
            generate_audio=AudioReply("ethan", max_frames=frames),
        )
        for i in range(concurrency)
    ]

    def one(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        for chunk in llm.start(requests[i], wait_for_room=True):
            if chunk.audio and not first[i]:
                first[i] = time.perf_counter() - t0
            samples[i] += len(chunk.audio) // 4
        total[i] = time.perf_counter() - t0

    wall = _run(one, concurrency)
    rtf = [t / (n / SAMPLE_RATE) for t, n in zip(total, samples, strict=True) if n]
    return {
        "ttfa_ms_mean": 1000 * statistics.mean(first),
        "ttfa_ms_max": 1000 * max(first),
        # A random talker may end a reply after a few frames, whose RTF is then its wait for
        # them: the median reads the bulk, the mean shows such outliers.
        "rtf_median": statistics.median(rtf),
        "rtf_mean": statistics.mean(rtf),
        "short_replies": sum(n < 0.5 * frames * 1920 for n in samples),
        "audio_seconds": sum(samples) / SAMPLE_RATE,
        "audio_seconds_per_second": sum(samples) / SAMPLE_RATE / wall,
    }


def text_beside(llm: LLM, texts: int, beside: int, tokens: int, frames: int) -> dict:
    """`texts` text requests' output tok/s, with `beside` spoken replies submitted with them."""
    ends = [0.0] * texts
    made = [0] * texts
    start = threading.Barrier(texts + beside)
    t0 = 0.0

    def one(i: int) -> None:
        nonlocal t0
        spoken = i >= texts
        params = SamplingParams(temperature=0.9, max_tokens=tokens, ignore_eos=True, seed=i)
        audio = AudioReply("ethan", max_frames=frames) if spoken else None
        request = llm.prepare(MESSAGES, params, generate_audio=audio)
        start.wait()
        t0 = t0 or time.perf_counter()
        for chunk in llm.start(request, wait_for_room=True):
            if not spoken:
                made[i] += len(chunk.token_ids)
        if not spoken:
            ends[i] = time.perf_counter()

    _run(one, texts + beside)
    return {"text_tokens": sum(made), "text_tok_s": sum(made) / (max(ends) - t0)}


def graph_check(path: Path, options: dict) -> dict:
    """Whether the CUDA graphs (the talker's decode steps, the code predictor's loop) give the
    eager steps' frames: a text read aloud (the talker's input fixed), greedy."""
    greedy = SamplingParams(temperature=0, max_tokens=60)
    said = {}
    for graphs in (True, False):
        with LLM(str(path), max_model_len=512, cuda_graphs=graphs, **options) as llm:
            said[graphs] = llm.speech(MESSAGES[0]["content"], greedy, voice="ethan")
    a, b = (torch.frombuffer(bytearray(said[g].audio), dtype=torch.float32) for g in (1, 0))
    return {
        "graphs_frames_equal": said[True].codes == said[False].codes,
        "graphs_frames": len(said[True].codes),
        "graphs_audio_max_diff": float((a - b).abs().max()) if a.shape == b.shape else None,
    }


def _run(one, count: int) -> float:
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    wall = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "wide"), default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--frames", type=int, default=125)
    parser.add_argument("--text", type=int, default=16)
    parser.add_argument("--beside", type=int, default=4)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--check-graphs", action="store_true", help="CUDA graphs against eager, greedy"
    )
    parser.add_argument(
        "--profile", action="store_true", help="time the talker's step phases (synchronizing)"
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "omni"
        t0 = time.perf_counter()
        write_checkpoint(path, args.shape)
        print(f"checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        options = {} if args.device is None else {"device": args.device}
        check = graph_check(path, options) if args.check_graphs else {}
        print(check, flush=True)
        batch = max(max(args.concurrency), args.text + args.beside)
        with LLM(
            str(path),
            enable_in_flight_batching=True,
            max_batch_size=batch,
            max_model_len=max(args.frames, args.text_tokens) + 256,
            **options,
        ) as llm:
            times = None
            if args.profile:
                times = time_phases(TalkerLoop, PHASES, llm._live().device)
            for c in args.concurrency:
                audio_chats(llm, c, 8, 8)  # warm-up at this batch
                for phase in (times or {}).values():
                    phase.clear()
                row = {"run": "audio_chats", "concurrency": c}
                row.update(audio_chats(llm, c, args.reply_tokens, args.frames))
                if times is not None:
                    row["phase_ms_mean"] = {
                        name: 1000 * statistics.mean(t) for name, t in times.items() if t
                    }
                print(row, flush=True)
                results.append(row)
            for beside in (0, args.beside):
                text_beside(llm, args.text, beside, 8, 8)  # warm-up
                row = {"run": "text_beside_speech", "texts": args.text, "spoken": beside}
                row.update(text_beside(llm, args.text, beside, args.text_tokens, args.frames))
                print(row, flush=True)
                results.append(row)
    write_report(
        report_path(f"omni_{args.shape}.json"),
        shape=args.shape,
        reply_tokens=args.reply_tokens,
        text_tokens=args.text_tokens,
        frames=args.frames,
        device=args.device or "auto",
        **check,
        results=results,
    )


if __name__ == "__main__":
    main()
