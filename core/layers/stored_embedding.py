"""A token embedding kept in a checkpoint's stored (quantized) form.

Wraps the VocabEmbedding the model built once its quantization method holds the stored rows
(quantization/gguf_linear.py `keep_stored`): each lookup gathers the rows it needs and
dequantizes only those, so no float copy of the vocabulary stays resident (SmolLM2's is 113 MB
in float32, more than its whole Q4_1 file's linear layers).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StoredVocabEmbedding(nn.Module):
    def __init__(self, stored: nn.Module, quant_method: Any) -> None:
        super().__init__()
        self.stored = stored                  # holds the method's buffers (and the shape-only weight)
        self.quant_method = quant_method

    @property
    def weight(self) -> torch.Tensor:
        return self.stored.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embed(self.stored, input_ids, self.stored.weight.dtype)
