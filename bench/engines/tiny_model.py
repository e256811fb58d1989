"""Write a small Llama-architecture checkpoint a serving engine loads like a downloaded one.

The device machine reaches no model hub, so an example that names a model (examples/
vllm_offline.py reads MODEL) needs one on disk: a config, random weights in safetensors and a
tokenizer trained here on a few sentences. Its outputs mean nothing; what it proves is that the
example runs as written, from the text prompt to the text answer.

    python3 bench/engines/tiny_model.py /tmp/tiny-llama && MODEL=/tmp/tiny-llama python3 ...
"""

from __future__ import annotations

import argparse
import pathlib

CORPUS = [
    "The capital of France is Paris.",
    "The capital of Italy is Rome, and the capital of Spain is Madrid.",
    "A key-value cache holds the attention keys and values of every token a model has seen.",
    "Pages are mapped into a virtual range when requests need them and unmapped when load drops.",
]


def write(out: pathlib.Path, vocab: int, hidden: int, layers: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    write(args.out, args.vocab, args.hidden, args.layers)
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
