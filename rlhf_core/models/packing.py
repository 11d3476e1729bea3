"""Padding-free forward passes over the rollout layout.

A [query | response] batch is mostly padding: prompts are left-padded to the longest prompt and responses
right-padded to the longest response. Scoring and training forwards instead lay the real tokens of several
rows end to end in one packed row, with position ids restarting at 0 for every sequence; transformers'
masks (packed-sequence detection) keep attention inside each sequence, so the outputs are those of the
padded forward at a fraction of the positions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from rlhf_core.models.families import attention_is_causal
from rlhf_core.models.sequences import positions_from_mask


#: A packed row holds up to this many times the longest sequence: fewer rows and less filler against an
#: attention cost that grows with the square of the row width.
PACK_ROW_FACTOR = 2
#: Pack only when it removes at least this fraction of the padded positions.
PACK_MIN_SAVING = 0.1


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded ``(B, T)`` batch sit in packed rows ``(R, W)``."""

    input_ids: torch.Tensor
    """(R, W) ids, sequences end to end; slots after a row's last sequence hold a filler token."""
    position_ids: torch.Tensor
    """(R, W) positions restarting at 0 for every sequence; 0 on filler slots (each its own sequence)."""
    source: torch.Tensor
    """(B, T) long: flat index into the R * W packed slots of each real token; R * W (a zero slot) elsewhere."""

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(R, W, ...) -> (B, T, ...) in the padded layout, 0 at padded slots. Differentiable."""
        flat = packed.reshape(-1, *packed.shape[2:])
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
        return flat[self.source.reshape(-1)].reshape(*self.source.shape, *packed.shape[2:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packing | None:
    """Pack the real tokens of each row (first-fit, longest first) into rows of at most ``PACK_ROW_FACTOR``
    times the longest sequence. (B, T), (B, T) -> :class:`Packing`, or None when that saves too little."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1).tolist()
    if max(lengths, default=0) == 0:
        return None
    capacity = PACK_ROW_FACTOR * max(lengths)
    used: list[int] = []  # filled slots of each packed row
    start = [0] * len(lengths)  # flat start slot of each sequence, before the row width is known
    row_of = [0] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, n in enumerate(used) if n + lengths[b] <= capacity), len(used))
        if row == len(used):
            used.append(0)
        row_of[b], start[b] = row, used[row]
        used[row] += lengths[b]
    width = max(used)
    if len(used) * width > (1.0 - PACK_MIN_SAVING) * mask.numel():
        return None
    positions = positions_from_mask(mask)  # (B, T)
    offsets = torch.tensor([r * width + s for r, s in zip(row_of, start, strict=True)], device=mask.device)
    source = torch.where(mask, offsets.unsqueeze(1) + positions, torch.full_like(positions, len(used) * width))
    slots = source[mask]
    ids = torch.full((len(used) * width,), int(input_ids[mask][0]), dtype=input_ids.dtype, device=mask.device)
    ids[slots] = input_ids[mask]
    packed_positions = torch.zeros(len(used) * width, dtype=torch.long, device=mask.device)
    packed_positions[slots] = positions[mask]
    return Packing(ids.view(len(used), width), packed_positions.view(len(used), width), source)


def padded_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    """``model(input_ids, attention_mask, position_ids)`` on a padded (B, T) batch, computed without padding.

    Tensor outputs (logits, hidden states) come back in the padded layout, 0 at padded slots; no KV cache is
    returned. Falls back to the padded forward when packing saves little or ``model`` cannot keep packed
    sequences apart (see :func:`supports_packing`).
    """
    packing = pack(input_ids, attention_mask) if supports_packing(model) else None
    if packing is None:
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=positions_from_mask(attention_mask), **kwargs)
    out = model(input_ids=packing.input_ids, position_ids=packing.position_ids, **{**kwargs, "use_cache": False})
    rows = packing.input_ids.shape
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.shape[:2] == rows:
            out[key] = packing.unpack(value)
        elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) and v.shape[:2] == rows for v in value):
            out[key] = tuple(packing.unpack(v) for v in value)
    return out


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps packed sequences apart by their position ids.

    True for a transformers model, or a PEFT / DeepSpeed wrapper of one (they pass keyword arguments through),
    whose attention modules are all causal (``families.attention_is_causal``; an encoder's modeling file may import
    the causal-mask helper and still attend both ways) and whose modeling code builds its attention masks with ``transformers.masking_utils.create_causal_mask``:
    given position ids, no attention mask and no cache, that mask lets a token attend only to earlier tokens
    of its own sequence. Anything else (older modeling code, custom modules) runs the padded forward.
    """
    try:
        from transformers import PreTrainedModel, masking_utils
    except ImportError:
        return False
    if not isinstance(model, PreTrainedModel) and type(model).__module__.split(".")[0] not in PASS_THROUGH_WRAPPERS:
        return False
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False
    if attention_is_causal(inner) is not True:  # an encoder attends both ways: packed sequences would see each other
        return False
    modeling = sys.modules.get(type(inner).__module__)
    uses_masks = getattr(modeling, "create_causal_mask", None) is masking_utils.create_causal_mask
    return uses_masks and getattr(inner.config, "_attn_implementation", None) in PACKED_ATTENTION


#: Attention implementations whose transformers masks (or varlen kernels) honour packed position ids.
PACKED_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"})
#: Packages whose model wrappers hand every keyword argument to the transformers model inside.
PASS_THROUGH_WRAPPERS = frozenset({"peft", "deepspeed"})
