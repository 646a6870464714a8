"""Turn batch requests (a JSON body or an uploaded JSON file) into validated queue items.

Every item is checked before anything is stored: unknown model -> 404, bad max_tokens or an
over-long prompt -> 400 naming the field and the prompt index. Uploads are parsed incrementally
(ijson), so a 200,000-prompt file never sits in memory as Python objects all at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import IO, Any

import ijson
from pydantic import ValidationError

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.generate import GenerateRequest, PromptObject, SamplingParams, UploadItem
from scalarlm.server.models import ModelCatalog
from scalarlm.server.prompt_check import PromptChecker

# Upload items validated (and prompt lengths counted) per chunk.
CHUNK = 2048


class BatchBuilder:
    """Builds queue payloads (`prompt`|`messages`, `sampling`, optional `model`) from wire requests."""

    def __init__(self, catalog: ModelCatalog, prompts: PromptChecker, default_max_tokens: int) -> None:
        self.catalog = catalog
        self.prompts = prompts
        self.default_max_tokens = default_max_tokens

    def sampling(self, params: SamplingParams, param_prefix: str = "") -> dict[str, Any]:
        """The sampling dict a worker receives, with the default max_tokens filled in and checked."""
        fields = params.model_dump(exclude_none=True, exclude_defaults=True)
        fields.setdefault("max_tokens", self.default_max_tokens)
        self.prompts.check_max_tokens(fields["max_tokens"], param=f"{param_prefix}max_tokens")
        return fields

    def from_request(self, request: GenerateRequest) -> tuple[str, list[dict[str, Any]]]:
        """(canonical model, items) for POST /v1/generate."""
        model = self.catalog.resolve(request.model)
        sampling = self.sampling(request.sampling())
        self.prompts.check_prompts([(i, text) for i, p in enumerate(request.prompts) if (text := _text(p)) is not None])
        return model, [_payload(p, sampling) for p in request.prompts]

    def from_upload(self, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
        """Items of an uploaded JSON list, validated chunk by chunk; raises InvalidRequest naming the item."""
        _expect_json_list(stream)
        items = enumerate(ijson.items(stream, "item", use_float=True))
        try:
            while chunk := list(islice(items, CHUNK)):
                yield from self._upload_chunk(chunk)
        except ijson.JSONError as exc:
            raise InvalidRequest(f"the uploaded file is not valid JSON: {exc}", param="file") from None

    def _upload_chunk(self, chunk: list[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        parsed: list[tuple[int, UploadItem]] = []
        for index, raw in chunk:
            if not isinstance(raw, dict):
                raw = {"prompt": raw}  # a bare string (or wrong type, which validation names)
            try:
                parsed.append((index, UploadItem.model_validate(raw)))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "item"
                raise InvalidRequest(f"item {index}: {field}: {first['msg']}", param=f"file[{index}].{field}") from None
        self.prompts.check_prompts([(i, t) for i, item in parsed if (t := _text(item.prompt_object())) is not None])
        for index, item in parsed:
            model = self.catalog.resolve(item.model)
            sampling = self.sampling(
                SamplingParams.model_validate(item.model_dump(include=set(SamplingParams.model_fields))),
                param_prefix=f"file[{index}].",
            )
            payload = _payload(item.prompt_object(), sampling)
            payload["model"] = model
            yield payload


def _text(prompt: str | PromptObject) -> str | None:
    return prompt if isinstance(prompt, str) else prompt.prompt


def _payload(prompt: str | PromptObject, sampling: dict[str, Any]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt, "sampling": sampling}
    if prompt.prompt is not None:
        return {"prompt": prompt.prompt, "sampling": sampling}
    return {"messages": [m.model_dump(exclude_none=True) for m in prompt.messages or []], "sampling": sampling}


def _expect_json_list(stream: IO[bytes]) -> None:
    """Fail fast (400) unless the file starts with a JSON list; leaves the stream at its start."""
    head = stream.read(4096).lstrip()
    stream.seek(0)
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if not head.startswith(b"["):
        raise InvalidRequest("the uploaded file must hold a JSON list of prompt objects", param="file")
