"""Random-weight GGUF models of real shapes, for timings and tests only (never quality).

    python -m sparq_llama.eval.random_gguf --shape llama2-7b --out /tmp/models/llama2-7b-q8_0.gguf \
        --vocab-dir vendor/llama.cpp/models

Q8_0 weights (random int8 quants, one small scale, so activations stay finite), f32 norms, and the real
tokenizer copied from llama.cpp's vocab files (models/ggml-vocab-llama-{spm,bpe}.gguf of the pinned tree,
vendor/llama.cpp after a build), so llama.cpp loads, tokenizes and runs the file like the real model. Weights of
one shape share one buffer. Used by the CUDA benchmarks of bench/ and by tests that need a model of a
given layout without a download.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("random_gguf")


@dataclass(frozen=True)
class Shape:
    name: str
    vocab_file: str  # in the pinned llama.cpp tree's models/
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    rope_base: float
    n_ctx_train: int = 131072


SHAPES = {
    "llama2-7b": Shape("llama2-7b", "ggml-vocab-llama-spm.gguf", 4096, 32, 32, 32, 11008, 10000.0),
    "llama3-8b": Shape("llama3-8b", "ggml-vocab-llama-bpe.gguf", 4096, 32, 32, 8, 14336, 500000.0),
    "tiny": Shape("tiny", "ggml-vocab-llama-spm.gguf", 256, 2, 4, 2, 512, 10000.0),  # for tests
}

Q8_0_BLOCK = 32
Q8_0_BYTES = 34  # f16 scale + 32 int8


def q8_0_pool(n_bytes: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random Q8_0 blocks (uint8 bytes): int8 quants uniform in [-127, 127], scale std / 73."""
    n_blocks = (n_bytes + Q8_0_BYTES - 1) // Q8_0_BYTES
    blocks = np.empty((n_blocks, Q8_0_BYTES), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, size=(n_blocks, Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(std / 73.0).tobytes(), dtype=np.uint8)
    return blocks.reshape(-1)


def copy_tokenizer(writer, vocab_path: Path) -> int:
    """Copies every tokenizer.* field of a llama.cpp vocab file; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(vocab_path)
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if n_vocab == 0:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


def write_model(shape: Shape, out: Path, vocab_dir: Path, seed: int = 0) -> Path:
    """Writes the model of `shape` to `out`, its tokenizer from `vocab_dir` (the pinned llama.cpp tree's models/)."""
    import gguf

    vocab_path = Path(vocab_dir) / shape.vocab_file
    if not vocab_path.exists():
        raise FileNotFoundError(f"{vocab_path}: build or fetch the pinned tree first (vendor/fetch.py)")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    n_vocab = copy_tokenizer(writer, vocab_path)
    head_dim = shape.n_embd // shape.n_head
    writer.add_name(f"random-{shape.name}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)

    e, kv, ff = shape.n_embd, shape.n_head_kv * head_dim, shape.n_ff
    largest = max(n_vocab * e, ff * e)
    pool = q8_0_pool(largest // Q8_0_BLOCK * Q8_0_BYTES, np.random.default_rng(seed))
    ones = np.ones(e, dtype=np.float32)

    def q8(name: str, n_out: int, n_in: int) -> None:
        row = n_in // Q8_0_BLOCK * Q8_0_BYTES
        writer.add_tensor(name, pool[: n_out * row].reshape(n_out, row), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    q8("token_embd.weight", n_vocab, e)
    for il in range(shape.n_layer):
        writer.add_tensor(f"blk.{il}.attn_norm.weight", ones)
        q8(f"blk.{il}.attn_q.weight", e, e)
        q8(f"blk.{il}.attn_k.weight", kv, e)
        q8(f"blk.{il}.attn_v.weight", kv, e)
        q8(f"blk.{il}.attn_output.weight", e, e)
        writer.add_tensor(f"blk.{il}.ffn_norm.weight", ones)
        q8(f"blk.{il}.ffn_gate.weight", ff, e)
        q8(f"blk.{il}.ffn_up.weight", ff, e)
        q8(f"blk.{il}.ffn_down.weight", e, ff)
    writer.add_tensor("output_norm.weight", ones)
    q8("output.weight", n_vocab, e)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    log.info("wrote %s (%.2f GB)", out, out.stat().st_size / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-dir", type=Path, required=True, help="the pinned llama.cpp tree's models/ folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_model(SHAPES[args.shape], args.out, args.vocab_dir, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
