"""Methods our engine's workers gain through vLLM's stock `--worker-extension-cls` (called with `collective_rpc`).

`refresh_embedding_kernels`: after `reload_weights`, re-run the embedding layers' post-load step. On vLLM's CPU
backend that step packs each embedding's weight for its matmul kernel (`dispatch_cpu_unquantized_gemm`), and the
output layer is an embedding layer too. A model served by vLLM's Transformers backend (SmolLM3 in vLLM 0.32) keeps
its tied output layer as a module of its own that shares the embedding's weight: `reload_weights` loads the new
embedding but leaves that module's packed copy at the old weights, so every token would be chosen by the base
model's head (measured: served tokens differed from transformers on the new checkpoint until this ran). On a GPU the
step does nothing for unquantized embeddings.

This module is imported inside vLLM's worker processes: it imports vLLM names through `vllm_api` only.
"""

from __future__ import annotations

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
