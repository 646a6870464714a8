"""Methods our engine's workers gain through vLLM's stock `--worker-extension-cls` (called with `collective_rpc`).

`reload_checkpoint`: vLLM's `reload_weights` from a checkpoint directory. With LoRA enabled, vLLM wraps each layer an
adapter may touch and its weight moves to `<module>.base_layer.weight`. Most vLLM 0.32.0 models load through
`AutoWeightsLoader`, which passes a checkpoint name to the wrapper, so a reload works. A model whose own loader looks
its parameters up by their checkpoint names fails on the first wrapped one (GraniteMoeHybrid:
`KeyError: 'embed_tokens.weight'`). The failure comes before anything is finalised; the checkpoint is then reloaded
with each wrapped layer's tensors named as the wrapper holds them (measured: served tokens then equal `transformers`
on the new checkpoint). The worker remembers this and reloads that way from then on.

`refresh_embedding_kernels`: after `reload_weights`, re-run the embedding layers' post-load step. On vLLM's CPU
backend that step packs each embedding's weight for its matmul kernel (`dispatch_cpu_unquantized_gemm`), and the
output layer is an embedding layer too. A model served by vLLM's Transformers backend (SmolLM3 in vLLM 0.32) keeps
its tied output layer as a module of its own that shares the embedding's weight: `reload_weights` loads the new
embedding but leaves that module's packed copy at the old weights, so every token would be chosen by the base
model's head (measured: served tokens differed from transformers on the new checkpoint until this ran). On a GPU the
step does nothing for unquantized embeddings.

`reload_fused_experts`: after `reload_weights` of a mixture-of-experts checkpoint. Two things the layerwise reload
of vLLM 0.32.0 leaves stale. (1) A model whose loader copies its fused experts straight into the parameters, past
any weight loader (gpt-oss with a bf16 checkpoint: `_load_weights_other`): the reload sees no load, logs
"GptOssRoutedExperts: Failed to load weights" and puts the old tensors back, on any device. `reload_checkpoint`
keeps a sample of each fused-experts layer's weights from before the reload; a layer whose sample did not change
was not loaded, and the checkpoint's expert tensors are then loaded through the model's own `load_weights` and
the layer's post-load step (`process_weights_after_loading`: padding, the backend's layout) run again on them,
as vLLM's weight-update path does (it copies into the same storage). (2) On CPU the experts are prepacked for the
grouped GEMM, a step the reload's own post-load processing skips (it runs only when the kernel is first built):
every layer is prepacked again. Measured on CPU: served tokens and logprobs then equal `transformers` on the new
checkpoint for every MoE family (as a fresh engine's do); the GPU branch of (1) is reasoned from vLLM's code, not
run (no GPU with vLLM here).

`reload_attention_sinks`: after `reload_weights` of a checkpoint with attention sinks (gpt-oss). vLLM 0.32.0's
gpt-oss loader copies each layer's `sinks` straight into the parameter, past any weight loader, so the layerwise
reload sees no load and puts the old sinks back (measured: after a swap the sinks were the base's and the served
logprobs differed from `transformers` on the new checkpoint; a fresh engine's equal them). This loads them through
the model's own `load_weights` once the reload is done. Not CPU-specific.

This module is imported inside vLLM's worker processes: it imports vLLM names through `vllm_api` only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

WORKER_EXTENSION = "scalarlm.inference.worker_extension.ScalarLMWorkerExtension"


class ScalarLMWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    model_runner: Any

    def reload_checkpoint(self, weights_path: str) -> bool:
        """Reload every weight from the checkpoint in `weights_path` (see the module docstring); whether the names
        were rewritten to LoRA's wrapped layers."""
        runner = self.model_runner
        self._expert_samples = {name: _sample(layer) for name, layer in _fused_experts(runner.model)}
        if not getattr(self, "_lora_wrapped_names", False):
            try:
                runner.reload_weights(weights_path=weights_path)
                return False
            except KeyError:
                if runner.lora_config is None:
                    raise
        runner.reload_weights(weights_iterator=_wrapped_names(runner.model, _checkpoint_tensors(weights_path)))
        self._lora_wrapped_names = True  # only once the wrapped names have loaded a whole checkpoint
        return True

    def refresh_embedding_kernels(self) -> list[str]:
        """Re-run the post-load step of every unquantized embedding layer (output layer included); their names."""
        from scalarlm.inference.vllm_api import UnquantizedEmbeddingMethod, VocabParallelEmbedding

        refreshed = []
        for name, module in self.model_runner.model.named_modules():
            if isinstance(module, VocabParallelEmbedding) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
                refreshed.append(name)
        return refreshed

    def reload_fused_experts(self, weights_path: str) -> int:
        """Reload the fused-experts layers `reload_checkpoint` left unchanged from the checkpoint in `weights_path`
        and, on CPU, prepack every layer again (see the module docstring); the number of layers reloaded."""
        model = self.model_runner.model
        layers = _fused_experts(model)
        samples = getattr(self, "_expert_samples", {})
        stale = [layer for name, layer in layers if _unchanged(layer, samples.get(name))]
        if stale:
            tensors = _checkpoint_tensors(weights_path, lambda name: ".experts." in name)
            if getattr(self, "_lora_wrapped_names", False):  # the model's loader needs LoRA's wrapped names
                tensors = _wrapped_names(model, tensors)
            model.load_weights(tensors)
        on_cpu = self.model_runner.device.type == "cpu"
        for _, layer in layers:
            if on_cpu:
                layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
            elif stale:  # a model's experts are loaded alike: all of its layers were left stale, or none
                layer.quant_method.process_weights_after_loading(layer)
        return len(stale)

    def reload_attention_sinks(self, weights_path: str) -> int:
        """Load the attention sinks of the checkpoint in `weights_path` (see the module docstring); how many."""
        sinks = list(_checkpoint_tensors(weights_path, lambda name: name.endswith(".sinks")))
        if sinks:
            self.model_runner.model.load_weights(iter(sinks))
        return len(sinks)


def _fused_experts(model: Any) -> list[tuple[str, Any]]:
    """(name, layer) of every fused-experts layer of `model`."""
    from scalarlm.inference.vllm_api import RoutedExperts

    return [(name, module) for name, module in model.named_modules() if isinstance(module, RoutedExperts)]


def _sample(layer: Any) -> Any:
    """A copy of up to 4,096 of the layer's `w13_weight` elements spread over all of it (enough to tell whether a load
    changed it); None where a backend replaced that weight (vLLM's MXFP4 kernels)."""
    weight = getattr(layer, "w13_weight", None)
    if weight is None:
        return None
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 4096)].clone()


def _unchanged(layer: Any, before: Any) -> bool:
    """Whether the layer's sample equals `before`, its sample from before the reload (False where either is None)."""
    now = _sample(layer)
    return before is not None and now is not None and bool(now.equal(before))


def _checkpoint_tensors(weights_path: str,
                        keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, Any]]:  # fmt: skip
    """(name, tensor) of every tensor `keep` accepts in the checkpoint's safetensors files."""
    from safetensors import safe_open

    for path in sorted(Path(weights_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)


def _wrapped_names(model: Any, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`tensors` with each name whose layer LoRA wraps renamed to the wrapper's `base_layer` (the layer found under
    the name itself or under the fused module it is packed into: q_proj -> qkv_proj)."""
    from scalarlm.inference.vllm_api import BaseLayerWithLoRA

    packed = {part: whole for whole, parts in getattr(model, "packed_modules_mapping", {}).items() for part in parts}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        for candidate in (module, f"{parent}.{packed.get(last, last)}"):
            try:
                wrapped = isinstance(model.get_submodule(candidate), BaseLayerWithLoRA)
            except AttributeError:
                continue
            if wrapped:
                name = f"{module}.base_layer.{leaf}"
                break
        yield name, tensor
