"""Refuse, at submission, a base model the trainer would refuse: same family rules, read without torch.

The control plane calls `check_base_model` before it writes or starts anything, so an unsupported architecture, an
unknown RoPE type, a tensor no rule maps or a tensor- or expert-parallel size that does not split the model is a
400 naming
the problem instead of a job that fails in the trainer.
"""

from __future__ import annotations

from pathlib import Path

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import TrainArgs
from scalarlm.training.families import check_moe_training, check_tensor_parallel, expert_rank, family_of, read_arch
from scalarlm.training.families.checkpoint import read_config, tensor_names
from scalarlm.training.families.spec import check_positions, lora_targets


def check_base_model(base_model: str, args: TrainArgs) -> None:
    """InvalidRequest (param "model" or "train_args") unless the trainer can train `base_model` with `args`.

    A base model that is not a local directory (a hub id) is resolved and checked elsewhere.
    """
    path = Path(base_model)
    if not path.is_dir():
        return
    try:
        arch = read_arch(read_config(path), tensor_names(path))
    except InvalidRequest as e:
        raise InvalidRequest(f"base model {path.name}: {e.message}", param=e.param or "model") from None
    check_tensor_parallel(arch, args.tensor_parallel_size)
    check_positions(arch, args.max_seq_len)
    expert_rank(arch, 0, args.expert_parallel_size)
    check_moe_training(arch, args.moe_aux_loss_coef, args.routing_replay)
    if args.adapter_type == "lora":
        lora_targets(family_of(arch), args.lora_config.target_modules)
