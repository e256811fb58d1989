"""SGLang on the device with no hub access: a Llama-architecture config written here, random
("dummy") weights, no tokenizer (token ids in, token ids out), greedy sampling, and an attention
backend that needs no FlashAttention-3 (`flash_ops` is not carried): Triton by default, FlashInfer
with --attention flashinfer (its kernels are JIT-compiled on first use, so that start is slower).
Usage: PYTHONPATH=$HOME/ssite python3 smoke.py [--attention triton|flashinfer] [--cuda-graph]
       [--requests 128] [--mem 0.3]"""

import argparse
import json
import pathlib
import time


def write_config() -> pathlib.Path:
    # The same 1B Llama shape as ../../../shared/vllm-on-device/smoke.py, so the engines compare.
    model_dir = pathlib.Path.home() / "llama-1b-config"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "vocab_size": 128256,
                "hidden_act": "silu",
                "tie_word_embeddings": True,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": 2,
            }
        )
    )
    return model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default="triton", choices=["triton", "flashinfer"])
    ap.add_argument("--cuda-graph", action="store_true", help="capture CUDA graphs (slower start)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--mem", type=float, default=0.3, help="mem_fraction_static")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args()

    import sglang
    from sglang.srt.entrypoints.engine import Engine

    print("sglang", sglang.__version__, flush=True)
    model_dir = write_config()
    t0 = time.time()
    engine = Engine(
        model_path=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        context_length=2048,
        mem_fraction_static=args.mem,
        random_seed=0,
        attention_backend=args.attention,
        sampling_backend="pytorch",
        disable_cuda_graph=not args.cuda_graph,
        log_level=args.log_level,
    )
    print("engine up in", round(time.time() - t0, 1), "s", flush=True)
    try:
        params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        prompts = [[(7 * i + j) % 50000 + 10 for j in range(128)] for i in range(args.requests)]
        # One request first: the first batch pays for Triton's JIT, which would distort tok/s.
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        print("first request's output ids:", first["output_ids"][:8], flush=True)
        t = time.time()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        dt = time.time() - t
        n_out = sum(len(o["output_ids"]) for o in outs)
        # Greedy on the same weights: the batched first prompt must repeat the single run.
        same = outs[0]["output_ids"] == first["output_ids"]
        print(
            len(outs),
            "requests,",
            n_out,
            "output tokens in",
            round(dt, 2),
            "s,",
            round(n_out / dt),
            "output tok/s; greedy repeatable:",
            same,
            flush=True,
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":  # SGLang starts its scheduler and detokenizer in spawned processes.
    main()
