"""Where a causal LM's output layer can run on chosen positions only.

Scoring and training need log-probs at the response tokens only, and generation's first (prompt) pass needs
the last position's logits only; for a large vocabulary the (B, T, V) logits of every position are the
biggest tensor of a PPO step. For the model families below the logits are exactly the output layer applied
to the backbone's last hidden state, so the output layer can be applied to the positions that are used.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

#: ``config.model_type`` of causal LMs whose logits are exactly ``get_output_embeddings()`` applied to the
#: backbone's last hidden state (no soft-capping, logit scaling or other post-processing in ``forward``).
PLAIN_LM_HEADS = frozenset({"gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3"})


def split_lm_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(backbone, output layer) of a causal LM whose logits are ``head(backbone(...).last_hidden_state)``.

    A PEFT wrapper is looked through (its adapters live inside the modules, and a disabled adapter stays
    disabled). Anything else (other architectures, DeepSpeed engines, custom modules) gives None: the
    caller runs the whole model.
    """
    inner = model
    if type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model"):
        inner = model.get_base_model()
    if not isinstance(inner, PreTrainedModel) or getattr(inner.config, "model_type", None) not in PLAIN_LM_HEADS:
        return None
    backbone, head = inner.base_model, inner.get_output_embeddings()
    if backbone is inner or not isinstance(head, nn.Linear):
        return None
    return backbone, head
