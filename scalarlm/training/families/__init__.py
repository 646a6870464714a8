"""Model families the trainer supports: one short declaration each, read without torch.

`FAMILIES` maps each HF `architectures` entry to its `Family`; `read_arch(config, tensor_names)` is the one place
that decides whether (and as what) a checkpoint is trained. The converter (`convert.py`), LoRA (`lora.py`) and the
model builder (`model.py`) work from the resulting `ModelArch` and never branch on the model type.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from scalarlm.training.families.apertus import APERTUS
from scalarlm.training.families.arcee import ARCEE
from scalarlm.training.families.cohere import COHERE, COHERE2
from scalarlm.training.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from scalarlm.training.families.ernie import ERNIE4_5
from scalarlm.training.families.exaone import EXAONE4
from scalarlm.training.families.gemma import GEMMA, GEMMA2, GEMMA3, GEMMA3_MM
from scalarlm.training.families.gemma import REFUSED as _REFUSED
from scalarlm.training.families.glm import GLM, GLM4
from scalarlm.training.families.gpt_neox import GPT_NEOX
from scalarlm.training.families.gpt_oss import GPT_OSS
from scalarlm.training.families.granite import GRANITE, GRANITE4, GRANITE_MOE
from scalarlm.training.families.granite import REFUSED as _GRANITE_REFUSED
from scalarlm.training.families.hunyuan import HUNYUAN
from scalarlm.training.families.llama import LLAMA, MISTRAL, QWEN2
from scalarlm.training.families.moe import GLM4_MOE, MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from scalarlm.training.families.nemotron import NEMOTRON
from scalarlm.training.families.olmo import OLMO2, OLMO3
from scalarlm.training.families.phi import PHI
from scalarlm.training.families.phi3 import PHI3
from scalarlm.training.families.qwen3 import QWEN3
from scalarlm.training.families.refused import REFUSED as _NOT_YET
from scalarlm.training.families.seed_oss import SEED_OSS
from scalarlm.training.families.smollm3 import SMOLLM3
from scalarlm.training.families.stablelm import STABLELM
from scalarlm.training.families.starcoder2 import STARCODER2
from scalarlm.training.families.spec import (
    Family,
    ModelArch,
    Refused,
    Rule,
    check_moe_training,
    check_tensor_parallel,
    expert_rank,
    hf_tensor_names,
    rules,
    whole_model,
)
from scalarlm.training.families.spec import read_arch as _read_arch

FAMILY_LIST: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3, PHI3, GEMMA, GEMMA2, GEMMA3, OLMO2, OLMO3,
                                   QWEN3_MOE, QWEN2_MOE, MIXTRAL, GRANITE, GLM, GLM4, GLM4_MOE, DEEPSEEK_V3,
                                   DEEPSEEK_V2, OLMOE, EXAONE4, ERNIE4_5, GRANITE4, GRANITE_MOE, GPT_OSS,
                                   SEED_OSS, STARCODER2, ARCEE, NEMOTRON, APERTUS,
                                   HUNYUAN, COHERE, COHERE2, GPT_NEOX, PHI, STABLELM, GEMMA3_MM)  # fmt: skip
FAMILIES: dict[str, Family] = {arch: f for f in FAMILY_LIST for arch in f.architectures}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILY_LIST}
REFUSED: dict[str, Refused] = {arch: r for r in (*_REFUSED, *_GRANITE_REFUSED, *_NOT_YET) for arch in r.architectures}


def read_arch(config: dict[str, Any], tensor_names: Iterable[str]) -> ModelArch:
    """The trained shape of the model (`config.json` dict + its tensor names); InvalidRequest naming what is refused."""
    return _read_arch(config, tensor_names, FAMILIES, REFUSED)


def family_of(arch: ModelArch) -> Family:
    return BY_NAME[arch.family]


__all__ = [
    "BY_NAME",
    "FAMILIES",
    "FAMILY_LIST",
    "REFUSED",
    "Family",
    "ModelArch",
    "Rule",
    "check_moe_training",
    "check_tensor_parallel",
    "expert_rank",
    "family_of",
    "hf_tensor_names",
    "read_arch",
    "rules",
    "whole_model",
]
