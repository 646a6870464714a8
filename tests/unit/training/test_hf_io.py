"""HF checkpoint files: lazy, sliced reads of sharded safetensors (counted) and publishing in the source's dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scalarlm.training import hf_io


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Three bf16/fp16/fp32 tensors written as three shards with an index."""
    gen = torch.Generator().manual_seed(0)
    state = {
        "a.weight": torch.randn(8, 6, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(10, 4, generator=gen).to(torch.float16),
        "c.bias": torch.randn(12, generator=gen),
    }
    files = hf_io.save_safetensors(tmp_path, state, max_shard_bytes=100)
    assert len(files) == 3 and (tmp_path / hf_io.INDEX_NAME).exists()
    return tmp_path, state


def test_index_maps_names_and_reads_are_lazy_and_counted(sharded) -> None:
    root, state = sharded
    index = json.loads((root / hf_io.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 8 * 6 * 2 + 10 * 4 * 2 + 12 * 4
    with hf_io.Weights(root, dtype=None) as w:
        assert set(w) == set(state) and w.bytes_read == 0  # names come from the index
        assert w.source_dtype("a.weight") == torch.bfloat16 and w.shape("b.weight") == (10, 4)
        rows = w.read_ranges("a.weight", 0, [(0, 2), (6, 8)])
        assert torch.equal(rows, torch.cat([state["a.weight"][0:2], state["a.weight"][6:8]]))
        cols = w.read_ranges("b.weight", 1, [(2, 4)])
        assert torch.equal(cols, state["b.weight"][:, 2:4])
        assert w.bytes_read == 4 * 6 * 2 + 10 * 2 * 2
        assert w.reads == [("a.weight", (4, 6)), ("b.weight", (10, 2))]
        assert w.stored_bytes() == index["metadata"]["total_size"]
    with hf_io.Weights(root) as w:  # default: cast each tensor to fp32 as it is read
        assert w["b.weight"].dtype == torch.float32
        assert torch.equal(w["b.weight"], state["b.weight"].float())
    assert hf_io.tensor_names(root) == set(state)
    assert hf_io.source_dtypes(root) == {k: v.dtype for k, v in state.items()}


def test_publish_keeps_source_dtypes_and_shards(sharded, tmp_path: Path) -> None:
    root, state = sharded
    (root / "config.json").write_text(json.dumps({"torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 0}))
    (root / "tokenizer.json").write_text("{}")
    (root / "chat_template.jinja").write_text("{{ messages }}")
    trained = {k: v.float() + 1 for k, v in state.items()}  # what the trainer holds: fp32
    dest = tmp_path / "out"
    dest.mkdir()
    hf_io.write_checkpoint(dest, trained, root, hf_io.read_config(root), hf_io.source_dtypes(root), max_shard_bytes=100)
    assert hf_io.source_dtypes(dest) == {k: v.dtype for k, v in state.items()}
    assert (dest / hf_io.INDEX_NAME).exists() and len(list(dest.glob("model-*.safetensors"))) == 3
    assert torch.equal(hf_io.load_weights(dest, torch.float16)["b.weight"], trained["b.weight"].half())
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] in ("bfloat16", "float16", "float32")
    assert json.loads((dest / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 1}
    assert (dest / "tokenizer.json").exists() and (dest / "chat_template.jinja").exists()

    single = tmp_path / "single"
    single.mkdir()
    hf_io.write_checkpoint(single, trained, root, {"dtype": "bfloat16"}, torch.float32)  # the job asked for fp32
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    assert set(hf_io.source_dtypes(single).values()) == {torch.float32}
    assert json.loads((single / "config.json").read_text())["dtype"] == "float32"


def test_publish_keeps_base_names_no_rule_produces(tmp_path: Path) -> None:
    """A tied model's saved lm_head is the trained embedding; derived RoPE buffers are copied as they were."""
    from scalarlm.training.export import keep_source_names

    embed = torch.randn(6, 4)
    inv_freq = torch.arange(2, dtype=torch.float32)
    base = {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(),
            "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq}  # fmt: skip
    hf_io.save_safetensors(tmp_path, base)
    trained = {"model.embed_tokens.weight": embed + 1}
    out = keep_source_names(trained, tmp_path, tied=("lm_head.weight", "model.embed_tokens.weight"))
    assert set(out) == set(base)
    assert torch.equal(out["lm_head.weight"], embed + 1) and out["lm_head.weight"].data_ptr() != embed.data_ptr()
    assert torch.equal(out["model.layers.0.self_attn.rotary_emb.inv_freq"], inv_freq)
    assert keep_source_names(trained, tmp_path, tied=None).keys() == set(base) - {"lm_head.weight"}


def test_an_entry_of_a_stacked_tensor_reads_only_its_slice(tmp_path: Path) -> None:
    """Granite 3 MoE's experts: one [E, 2I, H] tensor; `spec.stacked(name, e)` names expert e's [2I, H] slice, whose
    rows and columns are read alone (what a TP or EP rank holds)."""
    from scalarlm.training.families.spec import stacked

    experts = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1))
    hf_io.save_safetensors(tmp_path, {"w": experts})
    name = stacked("w", 2)
    with hf_io.Weights(tmp_path, dtype=None) as w:
        assert name in w and stacked("nope", 0) not in w and w.shape(name) == (6, 5)
        assert w.source_dtype(name) == torch.float32
        assert torch.equal(w[name], experts[2]) and w.bytes_read == 6 * 5 * 4
        assert torch.equal(w.read_ranges(name, 0, [(0, 1), (3, 5)]), torch.cat([experts[2, 0:1], experts[2, 3:5]]))
        assert torch.equal(w.read_ranges(name, 1, [(1, 3)]), experts[2, :, 1:3])
        assert w.reads[-1] == (name, (6, 2))


def test_a_view_of_a_stacked_entry_is_read_once_and_seen_as_the_rule_needs(tmp_path: Path) -> None:
    """GPT-OSS's experts: one [E, H, 2I] tensor of each expert's gate and up interleaved by column (x @ W); the
    views `even.T` and `odd.T` of expert e's entry are its gate and up as [I, H] (nn.Linear's layout), read from one
    read of the entry; rows of a view are the view's."""
    from scalarlm.training.families.spec import stacked

    experts = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(2))
    hf_io.save_safetensors(tmp_path, {"w": experts})
    gate, up = stacked("w", 1, "even.T"), stacked("w", 1, "odd.T")
    with hf_io.Weights(tmp_path, dtype=None) as w:
        assert gate in w and w.shape(gate) == (3, 5) and w.shape(stacked("w", 1, "T")) == (6, 5)
        assert torch.equal(w[gate], experts[1][:, 0::2].T) and torch.equal(w[up], experts[1][:, 1::2].T)
        assert w[gate].is_contiguous() and w.bytes_read == 5 * 6 * 4  # the entry, once for both views
        assert torch.equal(w.read_ranges(gate, 0, [(1, 3)]), experts[1][:, 0::2].T[1:3])
        with pytest.raises(ValueError, match="unknown view 'odd.X'"):
            stacked("w", 1, "odd.X")
