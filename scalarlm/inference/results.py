"""Turn vLLM's final `RequestOutput` into the protocol's `WorkResult`."""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.generate import Completion, TopLogprob, WorkItem, WorkResult


def sampled_logprobs(token_ids: Any, logprobs: Any) -> list[float] | None:
    """The log-probability of each sampled token (vLLM returns the top-k dict per position)."""
    if logprobs is None:
        return None
    return [float(position[token].logprob) for token, position in zip(token_ids, logprobs)]


def top_logprobs(logprobs: Any, k: int | None) -> list[list[TopLogprob]] | None:
    """The `k` most likely tokens at each position, most likely first (vLLM adds the sampled token to its top-k dict
    when it is not among them: left out here, its logprob is in `logprobs`)."""
    if logprobs is None or not k:
        return None
    return [
        [TopLogprob(token_id=token, token=lp.decoded_token, logprob=float(lp.logprob))
         for token, lp in sorted(position.items(), key=lambda pair: -pair[1].logprob)[:k]]
        for position in logprobs
    ]  # fmt: skip


def to_work_result(item: WorkItem, output: Any, version: int) -> WorkResult:
    """A finished request's result, stamped with the model name and weights version that produced it."""
    completions = [
        Completion(
            text=o.text,
            finish_reason=o.finish_reason,
            token_ids=list(o.token_ids),
            logprobs=sampled_logprobs(o.token_ids, o.logprobs),
            top_logprobs=top_logprobs(o.logprobs, item.sampling.logprobs),
            cumulative_logprob=o.cumulative_logprob,
        )
        for o in sorted(output.outputs, key=lambda o: o.index)
    ]
    prompt_ids = output.prompt_token_ids
    return WorkResult(
        request_id=item.request_id,
        model=item.model,
        version=version,
        outputs=completions,
        prompt_tokens=len(prompt_ids) if prompt_ids is not None else None,
    )


def error_result(item: WorkItem, message: str, version: int) -> WorkResult:
    """A result that tells the client why this one item failed."""
    return WorkResult(request_id=item.request_id, model=item.model, version=version, error=message)
