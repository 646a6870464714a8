"""RoPE angles per packed document (`model.rope_angles`) against transformers' own rotary embedding, per sequence."""

from __future__ import annotations

import torch

from scalarlm.training.families import read_arch
from scalarlm.training.model import longrope_inv_freq, rope_angles

ORIGINAL = 16
CONFIG = {
    "architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
    "original_max_position_embeddings": ORIGINAL, "partial_rotary_factor": 0.75,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(24)],
                     "long_factor": [1.0 + 2.0 * i for i in range(24)]},
}  # fmt: skip
NAMES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj",
                                           "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]  # fmt: skip


def _hf_cos_sin(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi-3 cos and sin ([length, rotary dim], attention factor included) for one sequence."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = Phi3RotaryEmbedding(Phi3Config(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    cos, sin = rope(torch.zeros(1, length, 8), torch.arange(length)[None])
    return cos[0], sin[0]


def test_each_packed_document_rotates_as_transformers_rotates_it_alone() -> None:
    """Short documents take the short factors, one longer than the original context the long ones, also when packed
    beside each other; a part continuing a shared prefix counts the prefix (its sequence is prefix + part)."""
    arch = read_arch(CONFIG, NAMES)
    short, long, original, attention = arch.longrope
    # documents 0..9 and 0..19; a prefix 0..7 continued by a part 8..19 (20 long), then a part 8..10 (11 long)
    sequences = [(10, range(10)), (20, range(20)), (20, range(20)), (11, range(8, 11))]
    positions = torch.cat([torch.tensor(list(p)) for _, p in sequences])[None]
    angles = rope_angles(longrope_inv_freq(arch, short), positions, (longrope_inv_freq(arch, long), original))
    assert angles.shape == (positions.shape[1], 1, 1, arch.rotary_dim)
    start = 0
    for length, span in sequences:
        cos, sin = _hf_cos_sin(length)
        ours = angles[start : start + len(span), 0, 0]
        assert torch.allclose(ours.cos() * attention, cos[list(span)], atol=1e-6)
        assert torch.allclose(ours.sin() * attention, sin[list(span)], atol=1e-6)
        start += len(span)
    # The mutation the test is for: with one factor set for the whole micro-batch, the short documents would move.
    assert not torch.allclose(rope_angles(longrope_inv_freq(arch, long), positions)[:10], angles[:10], atol=1e-3)


def test_plain_rope_angles_equal_megatrons_table() -> None:
    """Without scaling, the angles are megatron's own table read at each token's position (restarting per document)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=64, rotary_percent=0.75, use_cpu_initialization=True)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    freqs = rope.get_freqs_non_repeated(4)
    table = torch.cat((freqs, freqs), dim=-1)  # its `get_emb` (on the accelerator, where it moves inv_freq)
    assert torch.equal(rope_angles(rope.inv_freq, positions)[:, 0, 0], table[positions[0]])


def test_latent_rope_gives_deepseek_v3s_yarn_cos_and_sin_at_each_documents_positions() -> None:
    """MLA's RoPE module (`LatentRope`): angles over the rope dims at the current position ids (restarting per packed
    document) and yarn's attention factor as megatron's `mscale`, so cos * mscale and sin * mscale are transformers'
    DeepSeek-V3 cos and sin for each document alone."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from scalarlm.training.model import LatentRope, yarn_inv_freq
    from tests.unit.training.deepseek_configs import DEEPSEEK_V3, deepseek_arch

    arch = deepseek_arch(DEEPSEEK_V3)
    hf = DeepseekV3RotaryEmbedding(DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "architectures"}))
    positions = torch.cat([torch.arange(7), torch.arange(300)])[None]  # the second past the original 128 positions
    module = LatentRope(yarn_inv_freq(arch), lambda: positions, arch.yarn_rope[4])
    angles, mscale = module(positions.shape[1])
    assert angles.shape == (307, 1, 1, arch.mla.rope_dim)  # [S, B, 1, rope dims]
    for start, length in ((0, 7), (7, 300)):
        cos, sin = hf(torch.zeros(1, length, 8), torch.arange(length)[None])
        doc = angles[start : start + length, 0, 0]
        torch.testing.assert_close(torch.cos(doc) * mscale, cos[0], atol=2e-6, rtol=0)
        torch.testing.assert_close(torch.sin(doc) * mscale, sin[0], atol=2e-6, rtol=0)
