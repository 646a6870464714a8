"""Run by test_convert_logits.py as one plain process (TP=1) or under `mpirun -n 2` (TP=2).

For each model directory given: builds the megatron GPTModel on this rank's TP shard, loads the HF weights
through the converter, and prints one JSON line (rank 0) with
* `max_diff`: max |logits(HF transformers) - logits(megatron)| on a random batch (full causal mask);
* `packed_diff`: the same for two documents packed into one sequence with the per-document mask and
  restarting positions, against HF run on each document alone (no attention across documents);
* `long_diff`: the same on one sequence of `LONG` tokens, past the original context of a scaled RoPE (llama3)
  and much longer than any sliding window;
* `builtin_rope_diff` (llama3 models): `long_diff` with megatron's own llama3 scaling (hard-coded factors) instead
  of the config's: large, so the long positions really test the scaling;
* `logit_scale`: max |HF logit| (Gemma's scaled embeddings make logits ~3x larger than Llama's);
* `grad_diff` (TP=1): every parameter's gradient against HF's (`grad_diff`), or None where the converter cannot map
  HF's parameter names; `scalar_grad_diff` likewise over the one-element parameters (Apertus's xIELU alpha_p /
  alpha_n), None without any: each one's gradient is a sum over every activation of its layer, with cancellation, so
  fp32 summation order alone (this CPU's vector width) moves it further (measured 2.5e-5 relative on AVX-512);
* `roundtrip_exact`: gathering the TP shards and mapping mcore -> HF reproduces every HF tensor bit for bit;
* `loss_diff`: max |per-token cross-entropy of HF's packed logits - the trainer's| at the packed batch's loss
  positions, the trainer's computed as a training step does (`token_losses(..., loss_only=True)`: vocab-parallel
  output layer and cross-entropy at those positions only), and `loss_rows`, the positions it ran the output layer on.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

LONG = 600


def loaded_model(arch, par, hf: dict, parallel_output: bool):
    """This TP rank's GPTModel holding the HF weights (eval mode)."""
    from scalarlm.training.convert import hf_to_mcore, mark_tensor_parallel
    from scalarlm.training.model import build_gpt_model

    model = build_gpt_model(arch, par.tp_size, bf16=False, parallel_output=parallel_output)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in hf_to_mcore(hf, arch, par.tp_rank, par.tp_size).items():
            params[name].copy_(value)
    mark_tensor_parallel(model, arch)
    return model.eval()


def check(model_dir: Path, par) -> dict:
    from transformers import AutoModelForCausalLM

    from scalarlm.training import hf_io
    from scalarlm.training.convert import mcore_to_hf
    from scalarlm.training.data import Block, collate
    from scalarlm.training.export import gather_tp_shards, keep_source_names
    from scalarlm.training.model import model_arch

    from scalarlm.protocol.errors import InvalidRequest
    from scalarlm.training.model import check_tensor_parallel

    arch = model_arch(model_dir)
    try:
        check_tensor_parallel(arch, par.tp_size)
    except InvalidRequest as e:  # refused at this TP size, by name (at submission too)
        return {"model": model_dir.name, "tp": par.tp_size, "refused": e.message}
    hf = hf_io.load_weights(model_dir)
    model = loaded_model(arch, par, hf, parallel_output=False)
    # Eager attention: the reference computation (HF's SDPA path drops Gemma 2's attention soft cap).
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=gen)
    causal = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]
    doc_a = torch.randint(0, arch.vocab_size, (11,), generator=gen)
    doc_b = torch.randint(0, arch.vocab_size, (13,), generator=gen)
    # Targets inside each document (tokens 6-10 of the first, 17-23 overall of the second): 12 loss positions.
    targets = tuple(6 <= i <= 10 or 17 <= i for i in range(24))
    packed = collate([Block(tuple(torch.cat([doc_a, doc_b]).tolist()), targets, (0, 11))], pad_id=0)
    with torch.no_grad():
        ours = model(ids, torch.arange(24).expand(2, 24), causal)
        theirs = ref(ids).logits
        ours_packed = model(packed.tokens, packed.position_ids, packed.attention_mask)[0, :24]
        theirs_packed = torch.cat([ref(doc_a[None]).logits[0], ref(doc_b[None]).logits[0]])
        long_ids = torch.randint(0, arch.vocab_size, (1, LONG), generator=gen)
        long_mask = torch.ones(LONG, LONG, dtype=torch.bool).triu(1)[None, None]
        long_pos = torch.arange(LONG)[None]
        theirs_long = ref(long_ids).logits
        long_diff = (model(long_ids, long_pos, long_mask) - theirs_long).abs().max().item()
        builtin = None
        if arch.llama3_rope is not None:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            rope = model.rotary_pos_emb
            ours_freq = rope.inv_freq
            base = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
            rope.inv_freq = rope._apply_scaling(base, factor=arch.llama3_rope[0])
            RotaryEmbedding.forward.cache_clear()
            builtin = (model(long_ids, long_pos, long_mask) - theirs_long).abs().max().item()
            rope.inv_freq = ours_freq
            RotaryEmbedding.forward.cache_clear()
    grads = grad_diff(model, ref, arch, ids, causal) if par.tp_size == 1 else None
    dropout = dropout_check(model, ref, arch, ids, causal, ours) if par.tp_size == 1 else {}
    loss_diff, loss_rows = packed_loss_diff(loaded_model(arch, par, hf, parallel_output=True), packed, theirs_packed)
    shards = gather_tp_shards(model, arch, par)
    exact = None
    if shards is not None:  # (a multimodal checkpoint's tower and projector are carried through as publish does)
        back = keep_source_names(mcore_to_hf(shards, arch), model_dir, None, arch.carried)
        exact = set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    return {
        "model": model_dir.name,
        "tp": par.tp_size,
        "max_diff": (ours - theirs).abs().max().item(),
        "packed_diff": (ours_packed - theirs_packed).abs().max().item(),
        "long_diff": long_diff,
        "logit_scale": max(theirs.abs().max().item(), theirs_long.abs().max().item()),
        "builtin_rope_diff": builtin,
        "roundtrip_exact": exact,
        "loss_diff": loss_diff,
        "loss_rows": loss_rows,
        "grad_diff": grads and grads[0],
        "scalar_grad_diff": grads and grads[1],
        **dropout,
    }


def grad_diff(model, ref, arch, ids: torch.Tensor, causal: torch.Tensor) -> tuple[float, float | None] | None:
    """Over the megatron parameters with more than one element, and over the one-element ones (None: there are
    none), max |its gradient - HF's, mapped by the converter| / max(1, max |HF's|), of sum(logits * fixed random
    weights) on `ids`; None where transformers holds parameters under other names than the checkpoint's (transformers
    5 fuses some models' experts when it loads them), so the converter cannot map them."""
    from scalarlm.protocol.errors import InvalidRequest
    from scalarlm.training.convert import hf_to_mcore

    weights = torch.randn(*ids.shape, arch.vocab_size, generator=torch.Generator().manual_seed(1))
    (model(ids, torch.arange(ids.shape[1]).expand(*ids.shape), causal) * weights).sum().backward()
    (ref(ids).logits * weights).sum().backward()
    # a tied head is the embedding's (named once); transformers 5 loads GPT-NeoX's `embed_out` as `lm_head`
    theirs = {arch.hf_head if name == "lm_head.weight" else name: p.grad for name, p in ref.named_parameters()}
    if arch.carried:  # a multimodal model's module tree names its text model otherwise than its checkpoint does
        from transformers.core_model_loading import revert_weight_conversion

        theirs = revert_weight_conversion(ref, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    buffers = {name: torch.zeros_like(b) for name, b in ref.named_buffers() if name in ref.state_dict()}
    try:
        mapped = hf_to_mcore({**buffers, **theirs}, arch)
    except InvalidRequest:
        return None
    diffs = [(p.numel() == 1, (p.grad - mapped[name]).abs().max().item() / max(1.0, mapped[name].abs().max().item()))
             for name, p in model.named_parameters() if p.grad is not None]  # fmt: skip
    scalars = [diff for scalar, diff in diffs if scalar]
    return max(diff for scalar, diff in diffs if not scalar), max(scalars, default=None)


def dropout_check(model, ref, arch, ids: torch.Tensor, causal: torch.Tensor, eval_logits: torch.Tensor) -> dict:
    """One forward of each side in training mode: the dropouts it applies ({"<where> <p>": count} for p > 0; where:
    `attention` on the attention probabilities, `hidden` on a hidden-wide activation), and how far our logits move
    from eval mode's (exactly 0 without dropout: nothing else differs in training). Both are left in eval mode. At
    TP=1 (megatron refuses a training-mode MoE forward at TP > 1 without sequence parallelism, which the trainer uses
    there and this check does not)."""
    import torch.nn.functional as F

    sites: dict[str, Counter] = {"ours": Counter(), "hf": Counter()}
    side = ["ours"]
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def dropout_spy(x, p=0.5, training=True, inplace=False):
        if p > 0 and training:
            sites[side[0]][f"{'hidden' if x.shape[-1] == arch.hidden_size else 'attention'} {p:g}"] += 1
        return dropout(x, p, training, inplace)

    def sdpa_spy(*args, dropout_p=0.0, **kwargs):
        if dropout_p > 0:
            sites[side[0]][f"attention {dropout_p:g}"] += 1
        return sdpa(*args, dropout_p=dropout_p, **kwargs)

    F.dropout, F.scaled_dot_product_attention = dropout_spy, sdpa_spy
    try:
        with torch.no_grad():
            train_logits = model.train()(ids, torch.arange(ids.shape[1]).expand(*ids.shape), causal)
            side[0] = "hf"
            ref.train()(ids)
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa
        model.eval(), ref.eval()
    return {"dropout_ours": dict(sites["ours"]), "dropout_hf": dict(sites["hf"]),
            "train_vs_eval": (train_logits - eval_logits).abs().max().item()}  # fmt: skip


def packed_loss_diff(model, packed, theirs_packed: torch.Tensor) -> tuple[float, int]:
    """The loss-position cross-entropy of `model` (built as the trainer builds it: vocab-parallel output) against
    HF's packed logits; and how many positions went through its output layer."""
    import torch.nn.functional as F

    from scalarlm.training.losses import token_losses

    rows: list[int] = []
    model.output_layer.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0] * inp[0].shape[1]))
    mask = packed.loss_mask[0] > 0
    with torch.no_grad():
        ours = token_losses(model, packed, loss_only=True)[0]
        theirs = F.cross_entropy(theirs_packed, packed.labels[0], reduction="none")
    return (ours - theirs)[mask].abs().max().item(), sum(rows)


def main() -> int:
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    tp = int(sys.argv[1])
    env = launch_env_from(os.environ)
    par = init_parallel(env, tp, seed=0)
    try:
        for model_dir in sys.argv[2:]:
            result = check(Path(model_dir), par)
            if par.is_main:
                print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
