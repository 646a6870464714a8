"""`training.gpus_per_node` and `training.nodes` are what the SDK's get_gpu_count / get_node_count answer."""

from __future__ import annotations


async def test_gpu_and_node_counts_follow_the_training_settings(running_app) -> None:
    async with running_app(training={"gpus_per_node": 4, "nodes": 3}) as client:
        assert (await client.get("/v1/megatron/gpu_count")).json() == {"gpu_count": 12}
        assert (await client.get("/v1/megatron/node_count")).json() == {"node_count": 3}
