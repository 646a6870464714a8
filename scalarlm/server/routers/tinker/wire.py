"""Tinker's binary wire format: the forward_backward request in, ForwardBackwardOutput and SampleResponse out.

The SDK sends forward_backward as protobuf and accepts those two results only as protobuf. The message schema is
the SDK's own generated module (`tinker.proto.tinker_public_pb2`), imported on first use, so the control plane
needs the `tinker` package for these routes (the `dev` extra installs it) and refuses them without it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from scalarlm.protocol.errors import InvalidRequest

PROTO_MEDIA_TYPE = "application/x-protobuf"


def schema() -> ModuleType:
    """The SDK's message classes; refused (400, saying why) when the `tinker` package is not installed here."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise InvalidRequest(f"the Tinker routes need the `tinker` package on the control plane ({e}); "
                                     "pip install 'tinker==0.38.0'") from e  # fmt: skip
    return tinker_public_pb2


def _tensor_values(msg: Any, pb: ModuleType, name: str, index: int) -> list[float] | list[int]:
    """A Tensor message as a flat list (dense, or a sparse CSR matrix made dense)."""
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    dtype = dtypes.get(msg.dtype)
    if dtype is None:
        raise InvalidRequest(f"datum {index}: loss_fn_inputs[{name!r}] has an unsupported dtype", param="data")
    if msg.HasField("sparse_csr"):
        shape = list(msg.shape)
        if len(shape) != 2:
            raise InvalidRequest(f"datum {index}: sparse loss_fn_inputs[{name!r}] must be 2-D", param="data")
        dense = np.zeros(shape, dtype=dtype)
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense.reshape(-1).tolist()
    return np.frombuffer(msg.dense, dtype=dtype).tolist()


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """The request as plain data: model_id, seq_id, loss_fn, loss_fn_config, forward_only and data (datums with
    `tokens` and `loss_fn_inputs` lists)."""
    pb = schema()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError has no stable import path across versions
        raise InvalidRequest(f"forward_backward body is not a ForwardBackwardRequest protobuf: {e}") from e
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise InvalidRequest(f"datum {i}: only token (encoded_text) chunks are supported, not images or "
                                     "audio", param="data")  # fmt: skip
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {name: _tensor_values(t, pb, name, i) for name, t in datum.loss_fn_inputs.items()}
        data.append({"tokens": tokens, "loss_fn_inputs": inputs})
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    return {"model_id": msg.model_id, "seq_id": msg.seq_id, "loss_fn": msg.loss_fn or "cross_entropy",
            "loss_fn_config": config, "forward_only": msg.forward_only, "data": data}  # fmt: skip


def _batched(pb: ModuleType, rows: list[list[float]]) -> Any:
    arrays = [np.asarray(r, dtype=np.float32) for r in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    data = b"".join(a.tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def encode_forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """Per-datum `logprobs` and `elementwise_loss`, and the metrics, as a ForwardBackwardOutput."""
    pb = schema()
    fields = {name: _batched(pb, [o[name] for o in outputs]) for name in ("logprobs", "elementwise_loss")}
    record = pb.ArrayRecord(type_tag="ArrayRecord", fields=fields, num_datums=len(outputs))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics)
    return msg.SerializeToString()


def encode_sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list[float | None] | None) -> bytes:
    """Sequences (tokens, logprobs, stop_reason "stop" | "length") and optional prompt logprobs (NaN = none)."""
    pb = schema()
    stop = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = stop[seq["stop_reason"]]
        out.tokens = np.asarray(seq["tokens"], dtype=np.int32).tobytes()
        if seq.get("logprobs") is not None:
            out.logprobs = np.asarray(seq["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()
