"""GRPO, Dr. GRPO, DAPO, CISPO and SAPO: group-normalised advantages and an importance-ratio objective, per token.

* Advantages: rows are grouped by `group` (default: the prompt text, or the rendered messages); ``r - mean_g``,
  scaled as `scale_rewards` says (TRL's): "group" ``/ (std_g + eps)`` (unbiased std, the default of every loss but
  ``dr_grpo``), "batch" ``/ (std + eps)`` over every reward of the step, "none" unscaled (``dr_grpo``'s default).
* Objective per completion token (`surrogate`): ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` for
  grpo, dr_grpo and dapo, with ``eps_high`` = `clip_eps_high` (DAPO's clip-higher), or ``eps`` when unset; cispo's
  ``-min(ratio, eps_high).detach() * A * logp``; sapo's ``-sigmoid(t (ratio - 1)) 4 / t * A``; plus
  ``kl_coef * k3``, with ``ratio = exp(logp - logp_sampling)`` and ``k3 = exp(ref - logp) - (ref - logp) - 1``.
  With `importance_sampling_level` "sequence" (GSPO, TRL's) every token of a completion takes one ratio,
  ``exp(mean over its tokens of (logp - logp_sampling))``, its gradient reaching each of them through the mean.
  With TRL's `vllm_importance_sampling_correction` the ratio compares with the trainer's own logprobs of the batch
  and the policy term is weighted by the truncated or masked ``exp(logp_trainer - logp_sampling)`` (`sampler_weights`).
* Normalisation is a per-token weight: ``grpo`` averages tokens within a sequence and then sequences
  (``1 / (len_i * N)``); ``dr_grpo`` divides by a constant (``1 / (L * N)``, TRL's ``loss_type="dr_grpo"``, with
  ``L`` = `max_completion_length`, or the batch's longest completion when unset); ``dapo`` weighs every completion
  token of the step alike (``1 / sum_i len_i``, TRL's default ``loss_type="dapo"``), and so does ``cispo``;
  ``sapo`` is weighted as ``grpo`` (TRL's).
  The weights of the whole (global) batch sum the step's loss; micro-batches and DP ranks just add up. With
  `mask_truncated_completions` a completion that stopped at max_tokens weighs 0 (and leaves dapo's token count).
* Micro-batches are padding-free, packed as SFT's (`rl_micro_batches`); these per-token inputs ride along per document,
  so packing changes no term of the sum (the padded layout gives the same loss and gradients).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import RLRow, TrainArgs
from scalarlm.training.chat import prompt_ids
from scalarlm.training.data import Document, MicroBatch, balance_units, chunks, collate_packed, filler_micro, pack
from scalarlm.training.rows import read_rl_objects, rl_row_from_object

ADV_EPS = 1e-4


def advantages(rewards: Sequence[float], groups: Sequence[str], scaling: str) -> list[float]:
    """Group-centred advantages, scaled by each group's std (`scaling` "group"), the whole batch's ("batch"), or not
    at all ("none"). A group of equal rewards has advantage exactly 0."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    every = torch.tensor(list(rewards), dtype=torch.float64)
    batch_std = every.std() if len(rewards) > 1 else torch.zeros((), dtype=torch.float64)
    out = [0.0] * len(rewards)
    for idx in members.values():
        r = every[idx]
        if bool((r == r[0]).all()):
            continue  # equal rewards: exactly 0 (a float mean of equal values can miss them by an ulp)
        centred = r - r.mean()
        if scaling == "group":
            centred = centred / (r.std() + ADV_EPS)  # a group of one has equal rewards: skipped above
        elif scaling == "batch":
            centred = centred / (batch_std + ADV_EPS)
        for i, a in zip(idx, centred.tolist()):
            out[i] = a
    return out


@dataclass(frozen=True)
class RLDoc:
    """One scored completion as tokens: completion targets, its advantage and sampling logprobs (or None); whether
    its generation stopped at max_tokens (finish_reason "length")."""

    doc: Document
    advantage: float
    reward: float
    old_logprobs: tuple[float, ...] | None
    at_max_tokens: bool = False


def parse_rl_rows(rows: Sequence[dict[str, Any]]) -> list[RLRow]:
    """Validate RL rows (a session step's body); InvalidRequest naming the first bad row and field."""
    out = [rl_row_from_object(obj, f"row {i}", param="rows") for i, obj in enumerate(rows)]
    if not out:
        raise InvalidRequest("no rows", param="rows")
    return out


def _prompt_ids(tokenizer: Any, row: RLRow, index: int) -> list[int]:
    if row.messages is not None:
        return prompt_ids(tokenizer, row.messages, f"row {index}")
    return list(tokenizer(row.prompt or "", add_special_tokens=True)["input_ids"])


def encode_rl_rows(tokenizer: Any, rows: Sequence[RLRow], scaling: str, max_len: int
                   ) -> tuple[list[RLDoc], dict[str, Any]]:
    """Tokenize scored rows (prompt + completion [+ EOS]) with advantages (scaled as `scaling`: `advantages`); stats
    for metrics.

    Sampling logprobs must cover the completion tokens: with one more logprob than completion tokens the
    sampled EOS is appended; without logprobs EOS is appended (the model learns to stop); a count that matches
    neither means the completion re-tokenized differently and the row trains on-policy (ratio 1), counted.
    Rows with `completion_token_ids` (in the vocabulary) train on exactly those tokens, as sampled (EOS included
    when it was sampled); their logprobs must match them one to one, or the row is counted and trains on-policy.
    """
    adv = advantages([r.reward for r in rows], [r.group_key() for r in rows], scaling)
    vocab = len(tokenizer)
    docs, mismatched, truncated = [], 0, 0
    for index, (row, a) in enumerate(zip(rows, adv)):
        prompt = _prompt_ids(tokenizer, row, index)
        old = row.logprobs
        sampled = row.completion_token_ids
        if sampled is not None and not all(0 <= t < vocab for t in sampled):
            mismatched += 1  # not this model's tokens: train the text on-policy
            sampled, old = None, None
        if sampled is not None:
            completion = list(sampled)
            if old is not None and len(old) != len(completion):
                mismatched += 1
                old = None
        else:
            completion = list(tokenizer(row.completion, add_special_tokens=False)["input_ids"])
            if old is None or len(old) == len(completion) + 1:
                completion.append(tokenizer.eos_token_id)
            elif len(old) != len(completion):
                mismatched += 1
                old = None
        tokens = prompt + completion
        targets = [False] * len(prompt) + [True] * len(completion)
        if len(tokens) > max_len:
            truncated += 1
            tokens, targets = tokens[:max_len], targets[:max_len]
            if old is not None:
                old = old[: max(0, sum(targets))]
        if not any(targets[1:]):
            continue
        docs.append(RLDoc(Document(tuple(tokens), tuple(targets)), a, row.reward, tuple(old) if old else None,
                          row.finish_reason == "length"))  # fmt: skip
    if not docs:
        raise InvalidRequest("no trainable rows (every completion was empty or truncated away)", param="rows")
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float64)
    advs = torch.tensor(adv, dtype=torch.float64)
    stats = {
        "rows": len(rows),
        "groups": len({r.group_key() for r in rows}),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rows) > 1 else 0.0,
        "advantage_mean": float(advs.mean()),
        "advantage_std": float(advs.std()) if len(rows) > 1 else 0.0,
        "advantage_abs_max": float(advs.abs().max()),
        "logprobs_mismatched_rows": mismatched,
        "truncated_rows": truncated,
        "rows_at_max_tokens": sum(r.finish_reason == "length" for r in rows),
    }
    return docs, stats


@dataclass
class RLMicroBatch:
    """A padding-free micro-batch plus per-position (aligned with its labels, [1, T]) advantage, sampling logprob,
    whether that logprob is known, normalising weight and completion (segment)."""

    batch: MicroBatch
    advantages: Tensor
    old_logprobs: Tensor
    has_old: Tensor
    weights: Tensor
    # Which completion each position predicts a token of (its document's index in the step + 1; 0: none).
    segments: Tensor

    def to(self, device: torch.device) -> "RLMicroBatch":
        tensors = (self.advantages, self.old_logprobs, self.has_old, self.weights, self.segments)
        return RLMicroBatch(self.batch.to(device), *(t.to(device) for t in tensors))


def token_weights(docs: Sequence[RLDoc], loss: str, max_completion_length: int | None = None,
                  mask_at_max_tokens: bool = False) -> list[float]:  # fmt: skip
    """Per-document weight of each of its completion tokens (see module docstring). With `mask_at_max_tokens` (TRL's
    mask_truncated_completions) a completion that stopped at max_tokens weighs 0 and leaves dapo's token count, as
    TRL zeroes its completion mask; the sequence counts of grpo and dr_grpo still hold it, as TRL's do."""
    n = len(docs)
    lengths = [sum(d.doc.targets[1:]) for d in docs]
    kept = [not (mask_at_max_tokens and d.at_max_tokens) for d in docs]
    if loss == "dr_grpo":
        constant = max_completion_length or max(lengths)
        weights = [1.0 / (constant * n)] * n
    elif loss in ("dapo", "cispo"):
        total = sum(length for length, k in zip(lengths, kept) if k)
        weights = [1.0 / total if total else 0.0] * n
    else:
        weights = [1.0 / (length * n) for length in lengths]
    return [w if k else 0.0 for w, k in zip(weights, kept)]


def with_gradient(docs: Sequence[RLDoc], weights: Sequence[float]) -> tuple[list[RLDoc], list[float], int, int]:
    """The documents whose clipped objective has a gradient (advantage not 0: not in a group of equal rewards, not
    at their group's mean reward; weight not 0: not a masked completion) and their weights; how many were left out
    and their loss tokens.

    A document with advantage 0 adds exactly 0 to that loss and to its gradient at every token
    (`-min(ratio * 0, clip(ratio) * 0)`), so leaving it out changes neither, as long as nothing else (a KL term, a
    trained mixture-of-experts load-balancing loss) reads its tokens: the caller decides that. The weights stay as
    computed over every document."""
    useful = [d.advantage != 0.0 and w != 0.0 for d, w in zip(docs, weights)]
    kept = [i for i, u in enumerate(useful) if u]
    left = [d for d, u in zip(docs, useful) if not u]
    return ([docs[i] for i in kept], [weights[i] for i in kept], len(left),
            sum(sum(d.doc.targets[1:]) for d in left))  # fmt: skip


INPUTS = 5  # per-token inputs of a document: advantage, sampling logprob, has-logprob, weight, segment


def doc_token_inputs(doc: RLDoc, weight: float, segment: int = 1) -> Tensor:
    """[INPUTS, len(tokens)] advantage, sampling logprob, has-logprob, weight and `segment` (the document's id in its
    step, > 0) of one document, at the position that predicts each completion token (position p - 1 for target p,
    as its labels); zero elsewhere."""
    n = len(doc.doc.tokens)
    out = torch.zeros(INPUTS, n)
    positions = [p for p in range(1, n) if doc.doc.targets[p]]
    for j, p in enumerate(positions):
        out[0, p - 1], out[3, p - 1], out[4, p - 1] = doc.advantage, weight, segment
        if doc.old_logprobs is not None:
            # old_logprobs cover every completion token; the first target may be position 0 only if the prompt was
            # empty (never predicted), so align from the end.
            k = len(doc.old_logprobs) - len(positions) + j
            if 0 <= k < len(doc.old_logprobs):
                out[1, p - 1], out[2, p - 1] = doc.old_logprobs[k], 1.0
    return out


def _prompt_length(doc: Document) -> int:
    """Tokens before the first completion token."""
    return doc.targets.index(True) if True in doc.targets else len(doc.tokens)


def prompt_units(docs: Sequence[Document], max_len: int) -> list[list[int]]:
    """The documents (by index, in order of first appearance) that pack as one shared-prefix document: those with the
    same prompt tokens (a GRPO group's completions, as sampled), as many as fit in `max_len` tokens with the prompt
    once; every other document alone. A prompt of one token is not shared (nothing would be saved)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, doc in enumerate(docs):
        by_prompt.setdefault(doc.tokens[: _prompt_length(doc)], []).append(i)
    units: list[list[int]] = []
    for prompt, members in by_prompt.items():
        if len(prompt) < 2:
            units += [[i] for i in members]
            continue
        unit: list[int] = []
        size = len(prompt) - 1
        for i in members:
            part = len(docs[i].tokens) - (len(prompt) - 1)
            if unit and size + part > max_len:
                units.append(unit)
                unit, size = [], len(prompt) - 1
            unit.append(i)
            size += part
        units.append(unit)
    return units


def shared_prompt_tokens(docs: Sequence[Document], units: Sequence[Sequence[int]]) -> int:
    """The prompt tokens `units` compute once instead of once per document."""
    return sum((len(u) - 1) * (_prompt_length(docs[u[0]]) - 1) for u in units)


def rank_documents(docs: Sequence[Document], dp_size: int, max_len: int, share: bool) -> list[list[int]]:
    """Each DP rank's documents (indices, ascending; every rank computes the same split: all ranks hold every row).

    Without `share` (a trained MoE load-balancing loss): every `dp_size`-th row. With it: whole prompt units
    (`prompt_units`), so a group's rows share their prompt on one rank, not once per rank (at DP 8 a group of 8 rows
    dealt one to a rank would share nothing). A unit costs its tokens with the prompt once; one larger than half a
    rank's share of the batch is halved (each half computes the prompt again) until it is not, or is one row, and the
    units go largest first to the rank with the fewest tokens so far, as the ranks wait for the slowest
    (`data.balance_units`)."""
    if not share or dp_size == 1:
        return [list(range(r, len(docs), dp_size)) for r in range(dp_size)]

    def cost(unit: list[int]) -> int:
        return sum(len(docs[i].tokens) for i in unit) - shared_prompt_tokens(docs, [unit])

    return balance_units(prompt_units(docs, max_len), cost, dp_size)


def unit_document(docs: Sequence[Document], members: Sequence[int]) -> Document:
    """One document, or several with the same prompt as one shared-prefix document: the prompt but its last token,
    then each document from the prompt's last token on (that token predicts the completion's first), as parts that
    continue the prefix (`data.Document.parts`)."""
    if len(members) == 1:
        return docs[members[0]]
    cut = _prompt_length(docs[members[0]]) - 1
    tokens, targets, parts = list(docs[members[0]].tokens[:cut]), [False] * cut, []
    for i in members:
        parts.append(len(tokens))
        tokens += docs[i].tokens[cut:]
        targets += docs[i].targets[cut:]
    return Document(tuple(tokens), tuple(targets), tuple(parts))


def rl_micro_batches(
    docs: Sequence[RLDoc], weights: Sequence[float], max_len: int, blocks_per_micro: int, pad_id: int,
    count: int | None = None, share: bool = True,
) -> list[RLMicroBatch]:
    """The documents packed end to end as SFT's (`data.pack` into blocks of at most `max_len` tokens, in order),
    `blocks_per_micro` blocks per padding-free micro-batch (`collate_packed`: attention within each document); each
    document's advantages, sampling logprobs and weights ride along at its own positions. With `share`, the documents
    with the same prompt are one shared-prefix document each (`prompt_units`): the prompt is computed once for all
    of them, with the same loss and gradients. With `count`: exactly that many micro-batches: the same ones, after
    fillers (`data.filler_micro`) where the blocks make fewer."""
    plain = [d.doc for d in docs]
    units = prompt_units(plain, max_len) if share else [[i] for i in range(len(docs))]
    blocks = pack([unit_document(plain, u) for u in units], range(len(units)), max_len, packing=True)
    inputs = []
    for u in units:
        cut = 0 if len(u) == 1 else _prompt_length(plain[u[0]]) - 1  # the prefix predicts nothing: zeros
        inputs.append(torch.cat([torch.zeros(INPUTS, cut)]
                                + [doc_token_inputs(docs[i], weights[i], i + 1)[:, cut:] for i in u], 1))
    out, fillers, first = [], [], 0
    for span in chunks(len(blocks), blocks_per_micro, count):
        if not span:
            fillers.append(RLMicroBatch(filler_micro(pad_id), *torch.zeros(INPUTS, 1, 1)))
            continue
        chunk = blocks[span.start : span.stop]
        n_units = sum(b.documents for b in chunk)  # pack keeps the order: these are the next n_units units
        per_token = torch.cat(inputs[first : first + n_units], dim=1).unsqueeze(1)  # [INPUTS, 1, T]
        first += n_units
        out.append(RLMicroBatch(collate_packed(chunk, pad_id), *per_token))
    return fillers + out


@dataclass(frozen=True)
class Objective:
    """A GRPO step's per-token objective, from its TrainArgs (`of`): the surrogate ("clip": grpo, dr_grpo and dapo;
    "cispo"; "sapo"), its bounds or temperatures, the KL weight, the ratio's level and the sampler correction
    (TRL's vllm_importance_sampling_mode, None when off) with its [low, high] bounds."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    surrogate: str = "clip"
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # positive advantage, the others
    sequence_level: bool = False
    correction: str | None = None
    correction_bounds: tuple[float | None, float | None] = (None, 3.0)
    delta: float | None = None
    off_policy_threshold: float | None = None
    kl_bias_correction: bool = False

    @classmethod
    def of(cls, args: TrainArgs) -> "Objective":
        surrogate = args.loss if args.loss in ("cispo", "sapo") else "clip"
        correction = args.vllm_importance_sampling_mode if args.vllm_importance_sampling_correction else None
        return cls(args.clip_eps, args.clip_eps_high, args.kl_coef, surrogate,
                   (args.sapo_temperature_pos, args.sapo_temperature_neg), args.importance_sampling_level == "sequence",
                   correction, (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max),
                   args.delta, args.off_policy_mask_threshold, args.use_bias_correction_kl)

    @property
    def reads_segments(self) -> bool:
        """Some term is per completion (GSPO's ratio, a sequence-level sampler correction, the off-policy mask)."""
        return (self.sequence_level or (self.correction or "").startswith("sequence")
                or self.off_policy_threshold is not None)  # fmt: skip


def grpo_objective(
    logp: Tensor,
    old_logp: Tensor,
    has_old: Tensor,
    adv: Tensor,
    weights: Tensor,
    mask: Tensor,
    objective: Objective = Objective(),
    ref_logp: Tensor | None = None,
    first_logp: Tensor | None = None,
    segments: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted sum of the per-token objective (+ KL) and summed token stats (clipped, kl, the sampler
    correction's weights and the tokens it masked).

    The ratio compares the policy with the sampling logprobs; tokens without one compare with `first_logp` (the
    batch's first step, in its later steps), else with the policy itself (ratio 1). With the sampler correction on,
    every token's ratio compares with the trainer's own logprobs (`first_logp`, else the policy's, detached) and its
    objective is multiplied by `sampler_weights`. With `objective.sequence_level` the ratio is per completion (GSPO):
    the exp of the mean of its tokens' log ratios, over `segments` (each position's completion, as
    `RLMicroBatch.segments`). With `objective.off_policy_threshold` completions that drifted off-policy with a negative
    advantage are left out of the policy term (`off_policy_keep`); with `objective.kl_bias_correction` the KL term is
    multiplied by the ratio."""
    trainer_old = logp.detach() if first_logp is None else first_logp
    if objective.correction is None:
        old = torch.where(has_old > 0, old_logp, trainer_old)
    else:
        old = trainer_old
    log_ratio = logp - old
    if objective.sequence_level:
        log_ratio = sequence_mean(log_ratio, segments, mask)
    ratio = torch.exp(log_ratio)
    per_token, is_clipped = surrogate(ratio, logp, adv, objective)
    stats: dict[str, Tensor] = {"clipped_tokens": (is_clipped.float() * mask).sum().detach(),
                                "tokens": mask.sum().detach()}  # fmt: skip
    if objective.off_policy_threshold is not None:
        keep = off_policy_keep(logp, old_logp, has_old, adv, mask, segments, objective.off_policy_threshold)
        per_token = per_token * keep
        stats["off_policy_masked"] = ((1 - keep) * mask).sum()
    if objective.correction is not None:
        weight = sampler_weights(trainer_old, old_logp, has_old, mask, objective, segments)
        per_token = per_token * weight
        stats["correction_sum"] = (weight * mask).sum()
        stats["correction_masked"] = ((weight == 0).float() * mask).sum()
    if ref_logp is not None:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        stats["kl_sum"] = (kl * mask).sum().detach()
        if objective.kl_coef > 0:
            per_token = per_token + objective.kl_coef * (kl * ratio if objective.kl_bias_correction else kl)
    return (per_token * weights * mask).sum(), stats


def surrogate(ratio: Tensor, logp: Tensor, adv: Tensor, objective: Objective) -> tuple[Tensor, Tensor]:
    """The per-token policy term to minimise and where it is clipped.

    "clip": ``-min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)``, clipped where the clipped term is the smaller;
    with `delta` (two-sided clipping) the first ratio is ``min(ratio, delta)``.
    "cispo": ``-min(ratio, eps_high).detach() A logp`` (the weight caps, the gradient is the logprob's), clipped where
    the ratio passes the cap with A > 0 (TRL's cispo_clip_ratio). "sapo": ``-sigmoid(t (ratio - 1)) 4 / t A`` with
    t the temperature of A's sign (positive, else negative), never clipped."""
    if objective.surrogate == "cispo":
        cap = objective.clip_eps_high
        assert cap is not None  # TrainArgs requires it
        return -torch.clamp(ratio, max=cap).detach() * adv * logp, (ratio > cap) & (adv > 0)
    if objective.surrogate == "sapo":
        positive, negative = objective.sapo_temperatures
        t = torch.where(adv > 0, positive, negative)
        return -torch.sigmoid(t * (ratio - 1)) * 4 / t * adv, torch.zeros_like(ratio, dtype=torch.bool)
    high = objective.clip_eps if objective.clip_eps_high is None else objective.clip_eps_high
    clipped = torch.clamp(ratio, 1 - objective.clip_eps, 1 + high)
    if objective.delta is not None:  # two-sided: the unclipped term is capped too
        ratio = torch.clamp(ratio, max=objective.delta)
    return -torch.min(ratio * adv, clipped * adv), (ratio * adv) > (clipped * adv)


def off_policy_keep(logp: Tensor, sampler_logp: Tensor, has_old: Tensor, adv: Tensor, mask: Tensor,
                    segments: Tensor | None, threshold: float) -> Tensor:  # fmt: skip
    """TRL's off-policy sequence mask (DeepSeek-V3.2): 1 where a completion's advantage is >= 0 or the mean over its
    tokens of (sampling - policy logprob, detached; 0 for a token without a sampling logprob) is <= `threshold`, else
    0, at each of its positions."""
    kl = torch.where(has_old > 0, sampler_logp - logp.detach(), torch.zeros_like(logp))
    return ((adv >= 0) | (sequence_mean(kl, segments, mask) <= threshold)).to(logp.dtype)


def sampler_weights(trainer_logp: Tensor, sampler_logp: Tensor, has_old: Tensor, mask: Tensor, objective: Objective,
                    segments: Tensor | None) -> Tensor:  # fmt: skip
    """TRL's vLLM importance-sampling correction: ``exp(trainer - sampler logprob)`` per token ("token_*"), or of its
    sum over the completion ("sequence_*"), clipped to the bounds ("*_truncate") or 0 outside them ("*_mask"). A token
    without a sampling logprob adds 0 to the log ratio (weight 1 alone), as TRL's NaN logprobs do."""
    diff = torch.where(has_old > 0, trainer_logp - sampler_logp, torch.zeros_like(trainer_logp)) * mask
    mode = objective.correction or ""
    if mode.startswith("sequence"):
        diff = sequence_sum(diff, segments, mask)
    weight = torch.exp(diff)
    low, high = objective.correction_bounds
    if mode.endswith("_truncate"):
        return torch.clamp(weight, min=low, max=high)
    outside = torch.zeros_like(weight, dtype=torch.bool)
    if low is not None:
        outside |= weight < low
    if high is not None:
        outside |= weight > high
    return weight.masked_fill(outside, 0.0)


def _segment_sums(values: Tensor, segments: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each segment's sum of `values` and count over the masked positions, and each position's segment index."""
    ids = (segments * mask).long().flatten()
    flat = (values * mask).flatten()
    size = int(ids.max().item()) + 1 if ids.numel() else 1
    sums = torch.zeros(size, dtype=flat.dtype, device=flat.device).index_add(0, ids, flat)
    counts = torch.zeros(size, dtype=flat.dtype, device=flat.device).index_add(0, ids, mask.flatten().to(flat.dtype))
    return sums, counts, ids


def sequence_mean(values: Tensor, segments: Tensor, mask: Tensor) -> Tensor:
    """At each position, the mean of `values` over the masked positions of its segment (differentiable; segment 0 and
    unmasked positions are left out of every mean)."""
    sums, counts, ids = _segment_sums(values, segments, mask)
    return (sums / counts.clamp(min=1))[ids].view_as(values)


def sequence_sum(values: Tensor, segments: Tensor, mask: Tensor) -> Tensor:
    """At each position, the sum of `values` over the masked positions of its segment (as `sequence_mean`)."""
    sums, _, ids = _segment_sums(values, segments, mask)
    return sums[ids].view_as(values)


def read_rl_dataset(path: Any) -> list[dict[str, Any]]:
    """The scored rows of a GRPO job's dataset.jsonl, validated up front (InvalidRequest naming the line)."""
    return read_rl_objects(path)


@dataclass
class GroupStream:
    """GRPO jobs: an endless, seeded stream of whole groups (all rows of a group go into one step)."""

    groups: list[list[dict[str, Any]]]
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    offset: int = 0

    @classmethod
    def from_rows(cls, raw: list[dict[str, Any]], shuffle: bool, seed: int) -> "GroupStream":
        by_key: dict[str, list[dict[str, Any]]] = {}
        for obj in raw:
            by_key.setdefault(RLRow.model_validate(obj).group_key(), []).append(obj)
        return cls(list(by_key.values()), shuffle, seed)

    def _order(self) -> list[int]:
        import random

        order = list(range(len(self.groups)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict[str, Any]]:
        """The rows of the next `n` groups (wrapping into a reshuffled epoch)."""
        rows: list[dict[str, Any]] = []
        for _ in range(min(n, len(self.groups))):
            rows += self.groups[self._order()[self.offset]]
            self.offset += 1
            if self.offset >= len(self.groups):
                self.epoch, self.offset = self.epoch + 1, 0
        return rows

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
