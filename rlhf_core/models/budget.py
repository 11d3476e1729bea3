"""Token-budget micro-batching: consecutive chunks of rows whose forward holds at most ``max_tokens`` tokens.

Row micro-batching sets the peak by the longest batch: 16 rows of 2048 tokens cost 16 times 16 rows of 128. A
budget of tokens per forward instead lets short rows go many at a time and long ones few. Chunks are consecutive
runs of rows in their given order (results are concatenated back in that order, so no row moves), at most
``max_rows`` each; a row that alone exceeds the budget goes alone, never dropped.

What a chunk costs depends on the forward's layout: a padded forward computes ``rows x longest row`` positions, a
padding-free (packed, ``packing.padded_forward``) one about the sum of the rows' real lengths (its packed rows add
some filler on top).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rlhf_core.models.families import reads_last_token
from rlhf_core.models.packing import supports_packing


def chunk_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens of one forward over rows of these lengths: their sum when packed, else rows x the longest."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def token_chunks(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None,
                 packed: bool = False) -> list[range]:
    """Consecutive chunks of ``range(len(lengths))``, each at most ``max_rows`` rows and, when ``max_tokens`` is set,
    at most ``max_tokens`` tokens (:func:`chunk_cost`) unless it is one row longer than that.

    Greedy: a chunk grows until the next row would break a limit. ``max_tokens=None`` gives ``max_rows`` rows at a
    time, exactly the row micro-batching.
    """
    if max_rows < 1:
        raise ValueError(f"token_chunks: max_rows must be >= 1, got {max_rows}")
    chunks: list[range] = []
    start, longest, total = 0, 0, 0
    for i, n in enumerate(lengths):
        rows, grown_longest, grown_total = i - start + 1, max(longest, n), total + n
        cost = grown_total if packed else rows * grown_longest
        if rows > 1 and (rows > max_rows or (max_tokens is not None and cost > max_tokens)):
            chunks.append(range(start, i))
            start, longest, total = i, n, n
        else:
            longest, total = grown_longest, grown_total
    if start < len(lengths):
        chunks.append(range(start, len(lengths)))
    return chunks


def row_chunks(attention_mask: torch.Tensor, max_rows: int, max_tokens: int | None, packed: bool) -> list[range]:
    """:func:`token_chunks` of the rows of a (B, T) batch as they are: each row's real tokens when the forward packs
    them, else the whole width T (``rows x T`` positions per chunk)."""
    rows, width = attention_mask.shape
    lengths = attention_mask.sum(dim=1).tolist() if packed and max_tokens is not None else [width] * rows
    return token_chunks(lengths, max_rows, max_tokens, packed)


def pair_lengths(chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]], packed: bool) -> list[int]:
    """What each (chosen, rejected) pair adds to one forward of both sides, as a length for :func:`token_chunks`.

    Packed: ``len(chosen) + len(rejected)`` (costs add up). Padded: ``2 x max(len(chosen), len(rejected))``, so that
    ``pairs x longest`` is the forward's ``2 x pairs`` rows times its longest row.
    """
    return [len(c) + len(r) if packed else 2 * max(len(c), len(r)) for c, r in zip(chosen, rejected, strict=True)]


def pair_chunks(model: nn.Module, chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]], max_pairs: int,
                max_tokens: int | None = None) -> list[range]:
    """Consecutive chunks of (chosen, rejected) pairs whose both sides go through ``model`` in one scoring forward:
    at most ``max_pairs`` pairs and ``max_tokens`` tokens, counted packed where that forward packs rows."""
    packed = packs_scores(model)
    return token_chunks(pair_lengths(chosen, rejected, packed), max_pairs, max_tokens, packed)


def packs_scores(model: nn.Module) -> bool:
    """Whether ``roles.sequence_scores`` runs ``model`` padding-free: a decoder whose forward packs rows."""
    return reads_last_token(model) and supports_packing(model)


def split_to(chunks: Sequence[range], count: int) -> list[range]:
    """``chunks`` split (the one with most rows in halves, repeatedly) until there are ``count`` of them or every
    chunk is one row. Splitting only lowers each chunk's tokens; the rows stay in order.

    Data-parallel ranks must run the same number of training forwards (ZeRO-3 gathers weights in each one,
    collectively), while each rank's share of a batch may need another number of chunks.
    """
    parts = list(chunks)
    while len(parts) < count:
        widest = max(range(len(parts)), key=lambda k: len(parts[k]), default=None)
        if widest is None or len(parts[widest]) < 2:
            break
        chunk = parts[widest]
        middle = chunk.start + len(chunk) // 2
        parts[widest:widest + 1] = [range(chunk.start, middle), range(middle, chunk.stop)]
    return parts


def same_count(plans: Sequence[Sequence[range]], rank: int) -> list[tuple[range, bool]]:
    """Rank ``rank``'s chunks ``(rows, counted)`` when every rank runs as many forwards as the rank whose plan has
    most: its own plan ``plans[rank]`` split further (:func:`split_to`) and, where that cannot reach the count, its
    first row again, not counted (its loss weighs 0; it only keeps the collectives of the others going).

    Every rank can compute every rank's plan (they all hold the whole batch), so no rank has to ask.
    """
    count = max(len(plan) for plan in plans)
    parts = [(chunk, True) for chunk in split_to(plans[rank], count)]
    return parts + [(range(1), False)] * (count - len(parts))
