"""Batching tokenised examples: right-padded batches, or packed rows of several examples each.

Packing puts consecutive examples into one fixed-length row. Each example keeps its own position ids
(starting at 0), and the row carries **no attention mask**: transformers (5.x) then reads segment
boundaries from the position ids (``masking_utils.find_packed_sequence_indices``: a new segment starts
wherever the position does not grow by exactly one) and builds a block-diagonal causal mask for the
``sdpa`` and ``eager`` attention kernels, so no token attends across an example boundary. The padding
at the end of a row gets position ids starting at 0 too, so it forms a segment of its own.

Two details make a packed batch give exactly the loss of the same examples unpadded (tested to 1e-5 in
float32): an example's first token is never a target (unpacked, nothing precedes it; packed, the
previous example's last token would predict it), and padding is labelled ``IGNORE_INDEX``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.data.tokenize import TokenizedExample
from posttrain.models.attention import segment_kwargs
from posttrain.models.logprobs import IGNORE_INDEX, loss_positions


@dataclass
class PackedRow:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    example_ids: list[str]
    # Where each example starts in the row (parallel to example_ids); the padding segment is not listed.
    starts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def pack_examples(examples: list[TokenizedExample], max_length: int, pad_token_id: int = 0) -> list[PackedRow]:
    """Sequential greedy packing into rows of exactly ``max_length`` tokens.

    Examples stay in input order (the curriculum depends on it): each goes into the current row if it
    fits, otherwise it starts a new row. An example longer than ``max_length`` must already have been
    truncated (``ValueError`` otherwise). ``pad_token_id`` fills the rest of a row; its value never
    reaches the loss (label ``IGNORE_INDEX``, own segment).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    rows: list[PackedRow] = []
    current = PackedRow([], [], [], [])

    def close_row() -> None:
        padding = max_length - len(current.input_ids)
        current.input_ids.extend([pad_token_id] * padding)
        current.labels.extend([IGNORE_INDEX] * padding)
        current.position_ids.extend(range(padding))
        rows.append(current)

    for example in examples:
        length = len(example.input_ids)
        if length == 0:
            raise ValueError(f"example {example.id!r} has no tokens")
        if length != len(example.labels):
            raise ValueError(f"example {example.id!r}: {length} input ids but {len(example.labels)} labels")
        if length > max_length:
            raise ValueError(
                f"example {example.id!r} has {length} tokens, more than max_length={max_length}; "
                "truncate it first (tokenize_chat(..., max_length=...))"
            )
        if len(current.input_ids) + length > max_length:
            close_row()
            current = PackedRow([], [], [], [])
        current.starts.append(len(current.input_ids))
        current.example_ids.append(example.id)
        current.input_ids.extend(example.input_ids)
        current.labels.append(IGNORE_INDEX)
        current.labels.extend(example.labels[1:])
        current.position_ids.extend(range(length))
    if current.example_ids:
        close_row()
    return rows


def collate_padded(
    examples: list[TokenizedExample], pad_token_id: int, max_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad examples into ``input_ids``, ``labels`` (``IGNORE_INDEX`` on padding), ``attention_mask``
    and ``position_ids`` tensors of shape ``[batch, length]``; ``length`` is the longest example, or
    ``max_length`` when given (then every example must fit). Plus the loss positions found on the host
    (``posttrain.models.logprobs.loss_positions``)."""
    if not examples:
        raise ValueError("collate_padded needs at least one example")
    longest = max(len(example.input_ids) for example in examples)
    length = longest if max_length is None else max_length
    if longest > length:
        raise ValueError(f"an example has {longest} tokens, more than max_length={max_length}; truncate first")
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(example.labels, dtype=torch.long)
        attention_mask[row, :n] = 1
    # Positions simply count up; padding sits after the real tokens and is masked out.
    position_ids = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(len(examples), -1).clone()
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids,
            **loss_positions(labels)}


def collate_packed(rows: list[PackedRow]) -> dict:
    """Stack packed rows into ``input_ids``, ``labels`` and ``position_ids`` ``[rows, max_length]``, plus
    the example boundaries for varlen attention (``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``,
    ``posttrain.models.attention.segment_kwargs``; sdpa and eager ignore them) and the loss positions
    found on the host (``posttrain.models.logprobs.loss_positions``).

    Deliberately no ``attention_mask``: with it, transformers would skip the packed-sequence detection
    and let examples attend to each other.
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    lengths = {len(row.input_ids) for row in rows}
    if len(lengths) != 1:
        raise ValueError(f"packed rows have different lengths {sorted(lengths)}; pack them with one max_length")
    position_ids = torch.tensor([row.position_ids for row in rows], dtype=torch.long)
    labels = torch.tensor([row.labels for row in rows], dtype=torch.long)
    return {
        "input_ids": torch.tensor([row.input_ids for row in rows], dtype=torch.long),
        "labels": labels,
        "position_ids": position_ids,
        **segment_kwargs(position_ids),
        **loss_positions(labels),
    }
