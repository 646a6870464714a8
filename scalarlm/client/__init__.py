"""The scalarlm client (httpx). Imports only scalarlm.protocol: `pip install scalarlm` is enough."""

from scalarlm.client.async_client import AsyncScalarLM
from scalarlm.client.errors import GenerationFailed
from scalarlm.client.rl import AsyncRLSession, AsyncStepFuture, PipelineStep, RLSession, StepFuture
from scalarlm.client.sync_client import ScalarLM
from scalarlm.client.training import AsyncTrainingJob, TrainingFailed, TrainingJob

# ScalarLM's SDK name for the same client.
SupermassiveIntelligence = ScalarLM

__all__ = [
    "AsyncRLSession", "AsyncScalarLM", "AsyncStepFuture", "AsyncTrainingJob", "GenerationFailed", "PipelineStep",
    "RLSession", "ScalarLM", "StepFuture", "SupermassiveIntelligence", "TrainingFailed", "TrainingJob",
]  # fmt: skip
