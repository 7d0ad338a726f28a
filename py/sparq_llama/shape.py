"""The attention shape of a loaded model: head dim and head counts, which SparQ's transfer model and the
settings built on it depend on. Importing this module loads nothing native."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AttentionShape", "attention_shape"]


@dataclass(frozen=True)
class AttentionShape:
    head_dim: int
    n_head: int
    n_head_kv: int

    @property
    def gqa(self) -> bool:
        return self.n_head != self.n_head_kv


def attention_shape(llm: Any) -> AttentionShape:
    """head_dim and head counts of a loaded `Llama` (GGUF key_length where present, else n_embd / n_head)."""
    from llama_cpp import llama_cpp as lc

    n_head = lc.llama_model_n_head(llm.model)
    n_head_kv = lc.llama_model_n_head_kv(llm.model)
    arch = llm.metadata.get("general.architecture", "")
    key_length = llm.metadata.get(f"{arch}.attention.key_length")
    head_dim = int(key_length) if key_length else lc.llama_model_n_embd(llm.model) // n_head
    return AttentionShape(head_dim=head_dim, n_head=n_head, n_head_kv=n_head_kv)
