"""vLLM with its KV cache on kvasync (needs an NVIDIA GPU and vLLM 0.26.0-0.33.0).

The plugin is vLLM's own `vllm.general_plugins` entry point, installed with kvasync; it is
inert until a KVASYNC_* variable asks for it, and it reads them in the engine's processes, so
they are set before vLLM starts.
"""

import os

os.environ["KVASYNC_MEMORY_LIMIT"] = "4GiB"  # the KV cache's size; mapped as requests need it
os.environ["KVASYNC_NAME"] = "offline-example"  # its name in `kvasync top`

from vllm import LLM, SamplingParams  # after the variables: vLLM reads them

if __name__ == "__main__":
    llm = LLM(model=os.environ.get("MODEL", "meta-llama/Llama-3.2-1B"), max_model_len=2048)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(repr(outputs[0].outputs[0].text))
