"""The attention shapes of the models the benchmarks use (one table for every bench script that needs them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShape:
    n_layer: int
    n_head: int      # query heads
    n_head_kv: int
    d: int           # head dim

    def op_args(self) -> dict[str, int]:
        """The keyword arguments of sparq_llama.ops.bench_centroid / bench_attn for one layer of this shape."""
        return {"d": self.d, "n_head": self.n_head, "n_head_kv": self.n_head_kv}


HEAD_SHAPES = {
    "llama2-7b": HeadShape(32, 32, 32, 128),
    "llama3-8b": HeadShape(32, 32, 8, 128),
    "smollm2": HeadShape(30, 9, 3, 64),
}
