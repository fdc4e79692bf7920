"""Preference pairs on their way into a model: tokenise, batch, and turn a batch into per-sequence sums.

Shared by ``posttrain dpo`` (policy and reference log-probs) and ``posttrain rm`` (scalar rewards).

**Batch layouts.** Chosen and rejected always go through the model in *one* forward:

- ``prefix_sharing=False``: ``2B`` right-padded rows, chosen ``[0, B)`` then rejected ``[B, 2B)``.
- ``prefix_sharing=True`` (default): ``B`` rows, each ``[shared prompt | chosen suffix | rejected suffix]``.
  Position ids restart at the end of the prompt for the rejected suffix, and a 4-D attention mask lets
  each suffix see the prompt and itself but not the other suffix, so every token sees exactly the
  context it would see in its own row. The prompt is computed once instead of twice. The mask costs
  ``B·T²`` bytes (bool), which is small for the short pairs of a CPU run; for long contexts on a GPU,
  compare with ``prefix_sharing=false`` (the 2-D mask lets SDPA pick its fused kernels).

Both layouts produce, per target token, the flat index of the hidden state that predicts it
(``gather_index``), the token (``targets``) and the sequence it belongs to (``sequence_index``: chosen
``b`` → ``b``, rejected ``b`` → ``B + b``), so one forward function serves both.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain import dist
from posttrain.data.errors import DataError
from posttrain.data.io import write_jsonl as write_rows
from posttrain.data.records import PreferencePair
from posttrain.data.tokenize import TokenizedExample, tokenize_preference
from posttrain.models.attention import compute_dtype
from posttrain.models.logprobs import IGNORE_INDEX, POSITION_KEYS, chunked_token_logprobs, per_sequence_sum
from posttrain.progress import progress
from posttrain.store.run_store import working_dir

# Below ``dpo.min_pairs`` DPO stops (see ``TooFewPairs``); over fewer than TINY_SET_PAIRS (a lowered minimum)
# it passes over the set at most TINY_SET_EPOCHS times: 80 steps over 5 pairs are 128 passes, which memorise
# the pairs and make any held-out gain noise.
TINY_SET_PAIRS = 64
TINY_SET_EPOCHS = 4

NO_RESPONSE_LEFT = "no response tokens left after truncation"
IDENTICAL_AFTER_TRUNCATION = "chosen and rejected are identical after truncation"


def target_positions(labels: list[int]) -> list[int]:
    """Positions whose token is a training target. Position 0 never is: nothing precedes it to predict it."""
    return [t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX]


def _first_target(labels: list[int]) -> int:
    return next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def shared_prefix_length(chosen: TokenizedExample, rejected: TokenizedExample) -> int:
    """Leading tokens both sequences have in common *before either response starts* (the shared prompt)."""
    limit = min(_first_target(chosen.labels), _first_target(rejected.labels), len(chosen.input_ids),
                len(rejected.input_ids))
    shared = 0
    while shared < limit and chosen.input_ids[shared] == rejected.input_ids[shared]:
        shared += 1
    return shared


@dataclass
class TokenizedPair:
    index: int  # position in the dataset's list of pairs; the reference cache is indexed by it
    id: str
    chosen: TokenizedExample
    rejected: TokenizedExample
    shared: int
    chosen_targets: list[int]
    rejected_targets: list[int]
    tier: int | None = None
    difficulty: float | None = None
    rationale: str | None = None
    chosen_score: float | None = None
    rejected_score: float | None = None

    @property
    def truncated(self) -> bool:
        return self.chosen.truncated or self.rejected.truncated

    def row_tokens(self, prefix_sharing: bool) -> int:
        """Tokens this pair puts through the model (padding excluded)."""
        both = len(self.chosen.input_ids) + len(self.rejected.input_ids)
        return both - self.shared if prefix_sharing else both


@dataclass
class PairData:
    pairs: list[TokenizedPair]
    dropped: Counter
    dropped_ids: list[tuple[str, str]]  # (pair id, reason)
    truncated: int
    read: int = 0  # records read from the file (set by read_pairs)
    quarantined: int = 0


_NO_LIMIT = 1 << 40


def truncate_jointly(
    chosen: TokenizedExample, rejected: TokenizedExample, max_length: int, truncation_side: str
) -> tuple[TokenizedExample, TokenizedExample] | None:
    """Cut the *shared* prompt to one length for both sequences, so both answer the same (shortened) prompt.

    The prompt keeps ``max_length − longer response`` tokens, cut from the ``truncation_side`` end. When the
    longer response alone does not fit, the prompt is dropped and each response is cut from the right (as
    the data layer does). Returns None when the two prompts do not tokenise identically (then each
    sequence is truncated on its own by ``tokenize_prompt_completion``).
    """
    prompt = min(_first_target(chosen.labels), _first_target(rejected.labels))
    if chosen.input_ids[:prompt] != rejected.input_ids[:prompt] or prompt != _first_target(chosen.labels) \
            or prompt != _first_target(rejected.labels):
        return None
    keep = max_length - max(len(chosen.input_ids), len(rejected.input_ids)) + prompt

    def cut(example: TokenizedExample) -> TokenizedExample:
        ids, labels = example.input_ids, example.labels
        if len(ids) <= max_length and keep >= prompt:
            return example
        if keep <= 0:
            order = range(prompt, min(len(ids), prompt + max_length))
        else:
            kept = range(prompt - keep, prompt) if truncation_side == "left" else range(keep)
            order = [*kept, *range(prompt, len(ids))]
        return TokenizedExample([ids[i] for i in order], [labels[i] for i in order], True, example.id,
                                example.tier, example.difficulty)

    if keep >= prompt:
        return chosen, rejected
    return cut(chosen), cut(rejected)


def tokenize_pairs(
    records: list[PreferencePair], tokenizer, max_length: int, truncation_side: str, desc: str = "tokenize pairs"
) -> PairData:
    """Tokenise each pair against its prompt; pairs that truncation leaves unusable are dropped with a reason.

    A pair longer than ``max_length`` keeps both responses whole and shortens the prompt to the same
    tokens for both (``truncate_jointly``).
    """
    pairs, dropped, dropped_ids, truncated = [], Counter(), [], 0
    for record in progress(records, desc=desc, unit="pair", disable=not dist.is_main()):
        chosen, rejected = tokenize_preference(record, tokenizer, _NO_LIMIT, truncation_side)
        if max(len(chosen.input_ids), len(rejected.input_ids)) > max_length:
            joint = truncate_jointly(chosen, rejected, max_length, truncation_side)
            chosen, rejected = joint or tokenize_preference(record, tokenizer, max_length, truncation_side)
        truncated += chosen.truncated or rejected.truncated
        chosen_targets, rejected_targets = target_positions(chosen.labels), target_positions(rejected.labels)
        reason = None
        if not chosen_targets or not rejected_targets:
            reason = NO_RESPONSE_LEFT
        elif chosen.input_ids == rejected.input_ids and chosen.labels == rejected.labels:
            reason = IDENTICAL_AFTER_TRUNCATION
        if reason is not None:
            dropped[reason] += 1
            dropped_ids.append((record.id, reason))
            continue
        pairs.append(
            TokenizedPair(
                index=len(pairs), id=record.id, chosen=chosen, rejected=rejected,
                shared=shared_prefix_length(chosen, rejected),
                chosen_targets=chosen_targets, rejected_targets=rejected_targets,
                tier=record.tier, difficulty=record.difficulty, rationale=record.rationale,
                chosen_score=record.chosen_score, rejected_score=record.rejected_score,
            )
        )
    return PairData(pairs, dropped, dropped_ids, truncated)


class TooFewPairs(DataError):
    """Fewer usable training pairs than ``dpo.min_pairs`` (exit 2; a flywheel skips its DPO stage instead)."""

    def __init__(self, path: str, pairs: int, minimum: int):
        self.pairs, self.minimum = pairs, minimum
        super().__init__(path, None, None, (
            f"only {pairs} preference pairs, fewer than dpo.min_pairs={minimum}: DPO over so few memorises them "
            f"and its held-out gain is noise. Add pairs (more prompts, more samples per prompt), or set "
            f"dpo.min_pairs={max(pairs, 1)} to train on these knowingly (over fewer than {TINY_SET_PAIRS} pairs "
            f"the passes are then capped at {TINY_SET_EPOCHS})"))

    def __reduce__(self):  # rebuilt from its own parts when pickled to another rank (as DataError is)
        return TooFewPairs, (self.path, self.pairs, self.minimum)


def read_pairs(config, path: str, tokenizer, quarantine_suffix: str) -> PairData:
    """Read preference records (bad ones raise or are quarantined with a reason) and tokenise them.

    Every record is accounted for: ``read = accepted + quarantined`` and ``accepted = used + dropped``.
    """
    from posttrain.data.io import read_records
    from posttrain.train.runner import say

    quarantine = config.data.quarantine_path or f"{working_dir(config.output_dir, config.store.local_dir)}/quarantine{quarantine_suffix}.jsonl"
    records, report = read_records(
        path, kind="preference", fmt=config.data.format, on_error=config.data.on_error, quarantine_path=quarantine,
        split_across_ranks=True, max_record_bytes=config.data.max_record_bytes,
    )
    say(report.summary())
    report.check_usable("training set" if path == config.data.train else "eval set")  # nothing or mostly quarantined
    data = tokenize_pairs(records, tokenizer, config.train.max_length, config.data.truncation_side, f"tokenize {path}")
    data.read, data.quarantined = report.read, report.quarantined
    say(
        f"{path}: {report.accepted} pairs accepted = {len(data.pairs)} used + {sum(data.dropped.values())} dropped"
        + "".join(f" ({n}: {why})" for why, n in data.dropped.items())
        + f"; {data.truncated} truncated to {config.train.max_length} tokens (prompt cut from the "
        f"{config.data.truncation_side})"
    )
    if not data.pairs:
        raise DataError(path, None, None, f"no pair is usable after tokenisation at train.max_length="
                        f"{config.train.max_length} ({dict(data.dropped)}); raise train.max_length")
    return data


# ------------------------------------------------------------------------------------------------ batching

_SHARED, _CHOSEN, _REJECTED, _PAD = 0, 1, 2, 3


def _pair_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[R, 1, T, T]`` bool: query i may see key j iff j ≤ i and j is prompt or in i's own segment.

    Padding queries see only themselves (a fully masked row would give NaN in the softmax).
    """
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    keys, queries = segments[:, None, :], segments[:, :, None]
    allowed = causal & ((keys == _SHARED) | (keys == queries)) & (keys != _PAD)
    allowed |= torch.eye(length, dtype=torch.bool) & (queries == _PAD)
    return allowed.unsqueeze(1)


def _layout(pairs: list[TokenizedPair], prefix_sharing: bool):
    """Rows of (ids, positions, segments) and, per pair, where each sequence's token t sits: (row, column map)."""
    count = len(pairs)
    rows, where = [], []
    for b, pair in enumerate(pairs):
        c, r = pair.chosen.input_ids, pair.rejected.input_ids
        if prefix_sharing:
            p = pair.shared
            rows.append((c + r[p:], list(range(len(c))) + list(range(p, len(r))),
                         [_SHARED] * p + [_CHOSEN] * (len(c) - p) + [_REJECTED] * (len(r) - p)))
            where.append(((b, list(range(len(c)))), (b, list(range(p)) + list(range(len(c), len(c) + len(r) - p)))))
        else:
            where.append(((b, list(range(len(c)))), (count + b, list(range(len(r))))))
    if not prefix_sharing:
        sequences = [p.chosen.input_ids for p in pairs] + [p.rejected.input_ids for p in pairs]
        rows = [(ids, list(range(len(ids))), [_SHARED] * len(ids)) for ids in sequences]
    return rows, where


def collate_pairs(pairs: list[TokenizedPair], pad_token_id: int, prefix_sharing: bool) -> dict[str, torch.Tensor]:
    """Tensors for one forward over ``pairs`` (see the module docstring for the two layouts).

    Keys: ``input_ids``, ``position_ids``, ``attention_mask`` (2-D, or 4-D bool with prefix sharing),
    ``gather_index``, ``targets``, ``sequence_index``, ``last_index`` (``[2B]`` flat index of each
    sequence's last token, for reward heads), ``chosen_lengths`` / ``rejected_lengths`` (``[B]`` response
    token counts, float32) and ``pair_index`` (``[B]`` dataset index of each pair).
    """
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    # Checked here, from host integers: the losses skip this check on an accelerator (a host sync there).
    empty = [p.index for p in pairs if not p.chosen_targets or not p.rejected_targets]
    if empty:
        raise ValueError(f"collate_pairs: pairs {empty[:5]} have a response without loss tokens")
    count = len(pairs)
    rows, where = _layout(pairs, prefix_sharing)
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment_ids = torch.full((len(rows), width), _PAD, dtype=torch.long)
    for i, (ids, positions, segments) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        position_ids[i, : len(ids)] = torch.tensor(positions, dtype=torch.long)
        segment_ids[i, : len(ids)] = torch.tensor(segments, dtype=torch.long)
    gather, targets, sequence, last = [], [], [], [0] * (2 * count)
    for b, pair in enumerate(pairs):
        for offset, example, target_ts, (row, columns) in (
            (0, pair.chosen, pair.chosen_targets, where[b][0]),
            (count, pair.rejected, pair.rejected_targets, where[b][1]),
        ):
            # Token t is predicted by the hidden state of token t − 1 of the same sequence.
            gather.extend(row * width + columns[t - 1] for t in target_ts)
            targets.extend(example.input_ids[t] for t in target_ts)
            sequence.extend([offset + b] * len(target_ts))
            last[offset + b] = row * width + columns[-1]
    attention_mask = _pair_mask(segment_ids) if prefix_sharing else (segment_ids != _PAD).long()
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "gather_index": torch.tensor(gather, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "sequence_index": torch.tensor(sequence, dtype=torch.long),
        "last_index": torch.tensor(last, dtype=torch.long),
        "chosen_lengths": torch.tensor([len(p.chosen_targets) for p in pairs], dtype=torch.float32),
        "rejected_lengths": torch.tensor([len(p.rejected_targets) for p in pairs], dtype=torch.float32),
        "pair_index": torch.tensor([p.index for p in pairs], dtype=torch.long),
    }


MODEL_KEYS = ("input_ids", "position_ids", "attention_mask")


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The tensors the forward needs, moved to ``device`` (default: the rank's device)."""
    device = device or dist.device()
    keys = (*MODEL_KEYS, *POSITION_KEYS)
    return {key: batch[key].to(device) for key in keys}


# ------------------------------------------------------------------------------------------------ forward


def decoder_hidden(
    lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Final hidden states ``[R, T, H]`` of an HF decoder, with a 2-D padding mask or a 4-D bool mask.

    transformers passes a 4-D mask through unchanged. It is turned into one additive float mask (0 where
    allowed, the dtype's minimum elsewhere) here, once: eager attention needs it that way, and SDPA given
    a bool mask would convert it again in every layer and keep each copy for backward.
    """
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, lm.base_model_prefix)
    if attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        dtype = compute_dtype(attention_mask.device, decoder.get_input_embeddings().weight.dtype)
        blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
        attention_mask = torch.where(attention_mask, torch.zeros((), dtype=dtype, device=blocked.device), blocked)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return outputs.last_hidden_state


class PairLogprobModel(torch.nn.Module):
    """Root module for DPO: one forward returns the summed response log-prob of each of the ``2B`` sequences.

    Like ``TokenLogprobModel`` it is the FSDP root (so the output head stays gathered for the chunked
    head) and exposes the plain HF model as ``.lm`` for export.
    """

    def __init__(self, lm: torch.nn.Module, chunk_size: int = 1024):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        config = lm.config
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, attr, None) not in (None, 1.0):
                raise NotImplementedError(f"chunked log-probs do not support {attr} ({type(lm).__name__})")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        gather_index: torch.Tensor,
        targets: torch.Tensor,
        sequence_index: torch.Tensor,
    ) -> torch.Tensor:
        hidden = decoder_hidden(self.lm, input_ids, attention_mask, position_ids)
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_index)
        head = self.lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("chunked log-probs assume an output head without bias")
        token_logprobs = chunked_token_logprobs(selected, head.weight, targets, self.chunk_size)
        # One row per pair with prefix sharing (4-D mask), one row per sequence without.
        sequences = input_ids.shape[0] * (2 if attention_mask.dim() == 4 else 1)
        return per_sequence_sum(token_logprobs, sequence_index, sequences)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2B] → ([B] chosen, [B] rejected)``."""
    half = values.shape[0] // 2
    return values[:half], values[half:]


# ------------------------------------------------------------------------------------------------ outputs


def pair_summary(pair: TokenizedPair, extra: dict | None = None) -> dict:
    """One line of ``pairs.jsonl``: the pair's id, the annotator's rationale verbatim, its scores and sizes."""
    return {
        "id": pair.id,
        "rationale": pair.rationale,
        "chosen_score": pair.chosen_score,
        "rejected_score": pair.rejected_score,
        "tier": pair.tier,
        "difficulty": pair.difficulty,
        "chosen_tokens": len(pair.chosen.input_ids),
        "rejected_tokens": len(pair.rejected.input_ids),
        "shared_prompt_tokens": pair.shared,
        "truncated": pair.truncated,
        **(extra or {}),
    }


def write_jsonl(path: Path, rows) -> None:
    """Write ``rows`` as JSON lines on rank 0 (other ranks do nothing)."""
    if dist.is_main():
        write_rows(str(path), rows)
