"""Turn batch requests (a JSON body or an uploaded JSON file) into validated queue items.

Every item is checked before anything is stored: unknown model -> 404, bad max_tokens or an
over-long prompt -> 400 naming the field and the prompt index. Uploads are parsed incrementally
(ijson), so a 200,000-prompt file never sits in memory as Python objects all at once.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterator
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

    def __init__(self, catalog: ModelCatalog, prompts: PromptChecker, default_max_tokens: int,
                 max_prompts: int = 1_000_000) -> None:
        self.catalog = catalog
        self.prompts = prompts
        self.default_max_tokens = default_max_tokens
        self.max_prompts = max_prompts

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
        texts = [(i, text) for i, p in enumerate(request.prompts) if (text := _text(p)) is not None]
        if request.tools and texts:
            _refuse_tools_for_text(f"prompts[{texts[0][0]}]")
        self.prompts.check_prompts(texts)
        return model, [_payload(p, sampling, request.tools) for p in request.prompts]

    def from_upload(self, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
        """Items of an uploaded JSON list, validated chunk by chunk; raises InvalidRequest naming the item."""
        _expect_json_list(stream)
        items = enumerate(ijson.items(stream, "item", use_float=True))
        settled: dict[Hashable, tuple[str, dict[str, Any]]] = {}
        try:
            while chunk := list(islice(items, CHUNK)):
                if chunk[-1][0] >= self.max_prompts:
                    raise InvalidRequest(f"the upload holds more than {self.max_prompts} prompts", param="file")
                yield from self._upload_chunk(chunk, settled)
        except ijson.JSONError as exc:
            raise InvalidRequest(f"the uploaded file is not valid JSON: {exc}", param="file") from None

    def _upload_chunk(self, chunk: list[tuple[int, Any]], settled: dict[Hashable, tuple[str, dict[str, Any]]]
                      ) -> Iterator[dict[str, Any]]:
        texts: list[tuple[int, str]] = []
        payloads: list[dict[str, Any]] = []
        for index, raw in chunk:
            if not isinstance(raw, dict):
                raw = {"prompt": raw}  # a bare string (or a wrong type, which validation names)
            prompt = raw.get("prompt")
            # Fast path: a string prompt whose model and sampling fields were already validated on an
            # earlier item (SDK uploads repeat the same ones on every row).
            key = _settings_key(raw) if isinstance(prompt, str) and "messages" not in raw else None
            if key is not None and key in settled:
                model, sampling = settled[key]
                payload = {"prompt": prompt, "sampling": sampling}
            else:
                item = self._validate_item(index, raw)
                model = self.catalog.resolve(item.model)
                sampling = self.sampling(
                    SamplingParams.model_validate(item.model_dump(include=set(SamplingParams.model_fields))),
                    param_prefix=f"file[{index}].",
                )
                if key is not None:
                    settled[key] = (model, sampling)
                prompt_object = item.prompt_object()
                if item.tools and prompt_object.prompt is not None:
                    _refuse_tools_for_text(f"file[{index}]")
                payload = _payload(prompt_object, sampling, item.tools)
            if isinstance(payload.get("prompt"), str):
                texts.append((index, payload["prompt"]))
            payload["model"] = model
            payloads.append(payload)
        self.prompts.check_prompts(texts)
        yield from payloads

    @staticmethod
    def _validate_item(index: int, raw: dict[str, Any]) -> UploadItem:
        try:
            return UploadItem.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "item"
            raise InvalidRequest(f"item {index}: {field}: {first['msg']}", param=f"file[{index}].{field}") from None


def _settings_key(raw: dict[str, Any]) -> Hashable:
    """Everything of an upload row but its prompt, as a cache key (in the row's own key order: SDK rows all share
    one order; another order only misses the cache)."""
    key = tuple((k, v) for k, v in raw.items() if k != "prompt")
    try:
        hash(key)
    except TypeError:  # a list value (stop strings): fall back to its JSON text
        return json.dumps({k: v for k, v in raw.items() if k != "prompt"}, sort_keys=True)
    return key


def _text(prompt: str | PromptObject) -> str | None:
    return prompt if isinstance(prompt, str) else prompt.prompt


def _payload(prompt: str | PromptObject, sampling: dict[str, Any], tools: list[dict[str, Any]] | None = None
             ) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt, "sampling": sampling}
    if prompt.prompt is not None:
        return {"prompt": prompt.prompt, "sampling": sampling}
    payload = {"messages": [m.model_dump(exclude_none=True) for m in prompt.messages or []], "sampling": sampling}
    if tools:
        payload["tools"] = tools
    return payload


def _refuse_tools_for_text(where: str) -> None:
    raise InvalidRequest(
        f"tools reach the model through its chat template, and {where} is plain text: send it as "
        "{'messages': [...]} or drop tools",
        param="tools",
    )


def _expect_json_list(stream: IO[bytes]) -> None:
    """Fail fast (400) unless the file starts with a JSON list; leaves the stream at its start."""
    head = stream.read(4096).lstrip()
    stream.seek(0)
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if not head.startswith(b"["):
        raise InvalidRequest("the uploaded file must hold a JSON list of prompt objects", param="file")
