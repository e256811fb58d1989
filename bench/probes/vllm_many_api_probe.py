# mypy: disable-error-code="import-not-found,attr-defined,unused-ignore"
# (vLLM and its test tree are the probe's argument, not installed where mypy runs.)
"""Does vLLM's API still look as bench/_vllm_many_child.py drives it? On the CPU machine, with a
vLLM venv and its source tree (tests/vllm_matrix.py prepares both), no GPU needed:

    HF_HUB_OFFLINE=1 ~/.cache/kvasync/vllm-matrix/0.26.0/venv/bin/python \\
        bench/probes/vllm_many_api_probe.py ~/.cache/kvasync/vllm-matrix/0.26.0/src/vllm-0.26.0

It checks the names and signatures the trace loop calls (``LLMEngine.add_request``,
``abort_request``, ``has_unfinished_requests``, ``LLM._preprocess_cmpl``, ``get_metrics``,
``SamplingParams(output_kind=DELTA)``, ``TokensPrompt``), and runs ``StepCounter`` over vLLM's
real scheduler (built by vLLM's own test helper, ``tests/v1/core/utils.create_scheduler``, on a
1B config): one step of 6 requests of 40 tokens, 64 tokens a step, 12 blocks. Seen with 0.26.0:
the step's (tokens, running, waiting) = (64, 2, 4).
"""

from __future__ import annotations

import inspect
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    source = pathlib.Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(source))
    from vllm.platforms import current_platform

    # No accelerator on this machine: vLLM's config would refuse to infer a device.
    if not current_platform.device_type:
        current_platform.device_type = "cpu"
    import _vllm_many as plan
    from _vllm_many_child import StepCounter
    from tests.v1.core.utils import create_requests, create_scheduler
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    for name in ("add_request", "abort_request", "has_unfinished_requests", "step"):
        print(f"LLMEngine.{name}{inspect.signature(getattr(LLMEngine, name))}")
    for name in ("_preprocess_cmpl", "get_metrics"):
        assert hasattr(LLM, name), f"LLM.{name} is gone"
    SamplingParams(
        max_tokens=8,
        temperature=0,
        detokenize=False,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    TokensPrompt(prompt_token_ids=[1, 2, 3])
    model = plan.write_model_config(pathlib.Path(tempfile.mkdtemp()) / "llama-1b", "1b")
    scheduler = create_scheduler(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_blocks=12,
        block_size=16,
    )
    counter = StepCounter(scheduler)
    for request in create_requests(num_requests=6, num_tokens=40):
        scheduler.add_request(request)
    out = scheduler.schedule()
    waiting = len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ()))
    assert counter.last == (out.total_num_scheduled_tokens, len(scheduler.running), waiting)
    print(f"StepCounter after one step (tokens, running, waiting): {counter.last}")


if __name__ == "__main__":
    main()
