"""For each model directory given: the vLLM engine `scalarlm serve` builds for it (our settings' defaults through
`engine.parse_serve_args`, so the same flags: dtype, LoRA slots, CPU rotary, Transformers backend), run in this
process; its greedy answers and each chosen token's logprob, then the same after a full-weight swap (the worker calls
of `hot_swap.reload_calls`, then a prefix-cache reset) to a perturbed copy of the checkpoint written under the same
names (OUT_DIR/<model's name>). Prints one `RESULT {json}` line per model.
Usage: family_engine_check.py OUT_DIR MODEL_DIR...
(transformers' references are computed elsewhere: vLLM's Transformers backend patches transformers' model classes in
the process that runs it.)
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from hf_greedy import PROMPTS, TOKENS


def perturbed_copy(model: Path, dest: Path) -> Path:
    """`model` with noise (20% of each tensor's spread) on every floating tensor, under the same names and files: as
    a trained checkpoint of the family differs from its base."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    dest.mkdir(parents=True)
    for path in model.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, dest / path.name)
            continue
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                spread = float(tensor.float().std()) or 0.02
                tensors[name] = tensor + (0.2 * spread * torch.randn_like(tensor.float())).to(tensor.dtype)
        save_file(tensors, str(dest / path.name), metadata={"format": "pt"})
    return dest


def served(engine: Any) -> tuple[list[str], list[list[float]]]:
    """The engine's greedy answers to PROMPTS and each chosen token's logprob."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    outputs = [finished[str(i)] for i in range(len(PROMPTS))]
    return ([o.text for o in outputs],
            [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] for o in outputs])  # fmt: skip


def check(model: Path, out: Path) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from scalarlm.config import Settings
    from scalarlm.inference.engine import parse_serve_args
    from scalarlm.inference.hot_swap import reload_calls

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parse_serve_args(Settings(model=str(model)))))
    try:
        base = served(engine)
        trained = perturbed_copy(model, out / model.name)
        for method, kwargs in reload_calls(trained):
            engine.collective_rpc(method, kwargs=kwargs)
        engine.reset_prefix_cache()  # as the hot swap does (`WeightsManager._swap_full`)
        return {"model": model.name, "base": base, "swapped": served(engine), "swapped_dir": str(trained)}
    finally:
        engine.engine_core.shutdown()
        del engine
        gc.collect()


def main() -> None:
    from scalarlm.inference.process_env import configure_vllm_process_env

    configure_vllm_process_env()
    out = Path(sys.argv[1])
    for model in sys.argv[2:]:
        print("RESULT " + json.dumps(check(Path(model), out)), flush=True)


if __name__ == "__main__":
    main()
