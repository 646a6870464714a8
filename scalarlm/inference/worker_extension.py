"""Methods our engine's workers gain through vLLM's stock `--worker-extension-cls` (called with `collective_rpc`).

`refresh_embedding_kernels`: after `reload_weights`, re-run the embedding layers' post-load step. On vLLM's CPU
backend that step packs each embedding's weight for its matmul kernel (`dispatch_cpu_unquantized_gemm`), and the
output layer is an embedding layer too. A model served by vLLM's Transformers backend (SmolLM3 in vLLM 0.32) keeps
its tied output layer as a module of its own that shares the embedding's weight: `reload_weights` loads the new
embedding but leaves that module's packed copy at the old weights, so every token would be chosen by the base
model's head (measured: served tokens differed from transformers on the new checkpoint until this ran). On a GPU the
step does nothing for unquantized embeddings.

`reload_fused_experts`: after `reload_weights` of a mixture-of-experts checkpoint on CPU. vLLM 0.32.0's layerwise
reload sees no load into the fused experts (the model's loader writes them through the experts' own weight loader),
logs "RoutedExperts: Failed to load weights" and puts the old tensors back; and the CPU experts keep their weights
prepacked for the grouped GEMM, a step only the first load runs. This loads the checkpoint's expert tensors through
the model's own `load_weights` (its expert mapping) and prepacks them again (measured: served tokens then equal
`transformers` on the new checkpoint, as a fresh engine's do).

This module is imported inside vLLM's worker processes: it imports vLLM names through `vllm_api` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORKER_EXTENSION = "scalarlm.inference.worker_extension.ScalarLMWorkerExtension"


class ScalarLMWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    model_runner: Any

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
        """Load the expert tensors of the checkpoint in `weights_path` into every fused-experts layer and prepack
        them for the CPU kernel; the number of layers reloaded."""
        from safetensors import safe_open

        from scalarlm.inference.vllm_api import RoutedExperts

        model = self.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        if not layers:
            return 0

        def expert_tensors():
            for path in sorted(Path(weights_path).glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        if ".experts." in name:
                            yield name, f.get_tensor(name)

        model.load_weights(expert_tensors())
        for layer in layers:
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        return len(layers)
