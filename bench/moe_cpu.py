"""CPU throughput of a mixture-of-experts GGUF against a dense GGUF of the same active size.

Two random-weight files written with the `gguf` package (the default model's tokenizer, so that
the workload is real text): a Qwen3-MoE (`qwen3moe`, every layer `--experts` experts of
`--expert-ffn`, `--top-k` a token) and a dense Qwen3 whose feed-forward is `--top-k` x
`--expert-ffn` wide (the parameters a token reads are the same in both, but the router's). Both
run the offline workload of `inflight bench throughput` in `auto` quantization (the experts and
the dense layers stored in `--type`, run from their stored blocks); with `--llama-server BIN`,
llama.cpp's server runs the same files.

    .venv/bin/python bench/moe_cpu.py [--type Q8_0] [--prompts 16] [--llama-server BIN]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from inflight.bench.offline import load_tokenizer, make_workload, open_inflight, open_llama_server
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import default_model_path


def _copy_tokenizer(writer: gguf.GGUFWriter) -> int:
    """The default model's tokenizer fields into `writer`; returns its vocabulary size."""
    reader = gguf.GGUFReader(default_model_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    writer.add_token_list(tokens)
    writer.add_token_merges(reader.fields["tokenizer.ggml.merges"].contents())
    writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents())
    for key, add in (
        ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
    ):
        if key in reader.fields:
            add(reader.fields[key].contents())
    return len(tokens)


def write_file(path: Path, args: argparse.Namespace, moe: bool) -> Path:
    arch = "qwen3moe" if moe else "qwen3"
    hidden, heads, kv_heads, head_dim = args.hidden, args.hidden // 64, 4, 64
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _copy_tokenizer(writer)
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(args.top_k * args.expert_ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if moe:
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.top_k)
        writer.add_expert_feed_forward_length(args.expert_ffn)
    rng = np.random.default_rng(0)
    qtype = Q[args.type]

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        values = rng.normal(0.0, 0.02, shape).astype(np.float32)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, np.float32))

    add("token_embd.weight", vocab, hidden)
    ones("output_norm.weight", hidden)
    for i in range(args.layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", hidden)
        ones(b + "ffn_norm.weight", hidden)
        ones(b + "attn_q_norm.weight", head_dim)
        ones(b + "attn_k_norm.weight", head_dim)
        add(b + "attn_q.weight", heads * head_dim, hidden)
        add(b + "attn_k.weight", kv_heads * head_dim, hidden)
        add(b + "attn_v.weight", kv_heads * head_dim, hidden)
        add(b + "attn_output.weight", hidden, heads * head_dim)
        if moe:
            add(b + "ffn_gate_inp.weight", args.experts, hidden, quantize=False)
            add(b + "ffn_gate_exps.weight", args.experts, args.expert_ffn, hidden)
            add(b + "ffn_up_exps.weight", args.experts, args.expert_ffn, hidden)
            add(b + "ffn_down_exps.weight", args.experts, hidden, args.expert_ffn)
        else:
            ffn = args.top_k * args.expert_ffn
            add(b + "ffn_gate.weight", ffn, hidden)
            add(b + "ffn_up.weight", ffn, hidden)
            add(b + "ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_K", "Q6_K", "F16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, moe in (("moe", True), ("dense", False)):
            path = write_file(Path(tmp) / f"{name}.gguf", args, moe)
            work = make_workload(
                load_tokenizer(str(path)), args.prompts, args.prompt_len, args.output_len
            )
            with open_inflight(str(path), work, args.prompts) as timed:
                results[name] = {"inflight": timed(work.prompts)}
            if args.llama_server:
                with open_llama_server(args.llama_server, str(path), work, args.threads) as timed:
                    results[name]["llama-server"] = timed(work.prompts)
            print(name, {k: round(v, 1) for k, v in results[name].items()}, flush=True)
    write_report(report_path("moe_cpu.json"), args=vars(args), output_tok_s=results)


if __name__ == "__main__":
    main()
