"""The modules the FSDP2 engine builds around a Hugging Face backbone for the critic and the reward model.

``ValueModel`` is the critic (backbone + scalar value head); ``RewardModel`` reads a sequence
classifier's score at each row's last token. Both keep HF's submodule names (``model``, ``score``),
so their state-dict names are those of HF's ``*ForTokenClassification`` / ``*ForSequenceClassification``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from spmdrl.engines.optim import value_head_weight


class ValueModel(nn.Module):
    """HF backbone + scalar value head, named like HF's ``*ForTokenClassification`` (``model``, ``score``)."""

    def __init__(self, backbone: nn.Module, seed: int):
        super().__init__()
        self.config = backbone.config
        self.model = backbone
        hidden = self.config.hidden_size
        self.score = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        with torch.no_grad():
            self.score.weight.copy_(value_head_weight(hidden, seed))
            self.score.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        values_to_keep: int | torch.Tensor,
        **packed,
    ) -> torch.Tensor:
        """Values of the last ``values_to_keep`` positions [n, values_to_keep], or, for a packed row
        (``packed``: its sequence boundaries), of the positions ``values_to_keep`` indexes [k]."""
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **packed,
        ).last_hidden_state  # [n, P+R, H]
        hidden = hidden[0, values_to_keep] if packed else hidden[:, -values_to_keep:]
        # A fresh tensor, not a squeeze view: FSDP2 warns on a root output that is a view (its
        # pre-backward hook would be skipped by an in-place op on it). Tiny.
        return self.score(hidden).squeeze(-1).clone()


class RewardModel(nn.Module):
    """A Hugging Face ``*ForSequenceClassification`` (one label) whose score is read at each row's last
    attended token, whatever the padding side (as verl's reward worker: argmax of position_ids x mask).

    The wrapper is the FSDP root, so its forward unshards the root's parameters (embeddings, final norm,
    head) before the backbone and head run; the submodules keep HF's names (``model``, ``score``).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.config = hf_model.config
        self.model = getattr(hf_model, hf_model.base_model_prefix)
        self.score = hf_model.score

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, last: torch.Tensor | None = None, **packed) -> torch.Tensor:
        """Scores [n]; a packed row (``packed``: its sequence boundaries) gives the index ``last`` [n] of
        each sequence's last token."""
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **packed,
        ).last_hidden_state  # [n, L, H]
        if last is not None:
            return self.score(hidden[0, last]).squeeze(-1)  # [n]
        last = torch.argmax(position_ids * attention_mask, dim=-1)  # [n]
        return self.score(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1)  # [n]
