"""The saved prefix's files as bytes, for tests that damage, inspect or rewrite them: the sidecar's format 4 (parts
framed by their length and checksum, then the record of the KV state file saved with it) and the checksum itself,
written again here from its definition (sparq-state-file.cpp, hash64) so that the format is pinned independently of
the C code."""
from __future__ import annotations

import struct
from dataclasses import dataclass

MASK = (1 << 64) - 1
M1, M2, M3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def hash64(data: bytes) -> int:
    """The sidecar's checksum of `data` (slow: for parts of a few KB)."""
    n = len(data)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, n - n % 8, 8)]
    lane = [M1, M2, M3, M1 ^ M2]
    i = 4 * (n // 32)  # the words the four lanes take, 32 bytes at a time
    for block in range(0, i, 4):
        for j in range(4):
            lane[j] = _rotl(lane[j] ^ (words[block + j] * M2 & MASK), 29) * M1 & MASK
    h = (_rotl(lane[0], 1) + _rotl(lane[1], 9) + _rotl(lane[2], 17) + _rotl(lane[3], 25) + n * M3) & MASK
    for w in words[i:]:
        h = _rotl(h ^ (w * M2 & MASK), 31) * M1 & MASK
    for b in data[len(words) * 8:]:
        h = (h ^ b) * 0x100000001B3 & MASK
    h ^= h >> 31
    h = h * M2 & MASK
    h ^= h >> 29
    h = h * M3 & MASK
    h ^= h >> 32
    return h


@dataclass
class Part:
    at: int        # where its framing (length, checksum) starts in the file
    length: int
    checksum: int

    @property
    def payload(self) -> int:
        """Where its bytes start."""
        return self.at + 16


def version(data: bytes) -> int:
    return struct.unpack_from("<I", data, 4)[0]


def parts(data: bytes) -> list[Part]:
    """A format-4 sidecar's parts, in order."""
    assert data[:4] == b"SQZP" and version(data) == 4, "a sidecar of format 4 is expected"
    out, at = [], 8
    while at < len(data):
        length, checksum = struct.unpack_from("<QQ", data, at)
        out.append(Part(at, length, checksum))
        at += 16 + length
    assert at == len(data)
    return out


def part_names(data: bytes, layer_ids: list[int]) -> list[str]:
    """The names load gives the parts of a sidecar (for the cache's layers `layer_ids`), in order."""
    names = ["header", "prefix tokens", "layer count"]
    for il in layer_ids:
        names += [f"layer {il} {what}" for what in ("settings", "cluster table", "cluster assignments",
                                                     "coarse table", "parent map")]
    names.append("calibration query count")
    n_calib = len(parts(data)) - len(names) - 1
    names += [f"calibration queries (entry {i})" for i in range(n_calib)]
    return names + ["KV state record"]


def state_record(data: bytes) -> tuple[int, list[tuple[str, int, int, int]]]:
    """The KV state file's size and parts (name, offset, length, checksum) a format-4 sidecar records."""
    last = parts(data)[-1]
    at = last.payload
    size, n = struct.unpack_from("<QI", data, at)
    at += 12
    out = []
    for _ in range(n):
        (k,) = struct.unpack_from("<Q", data, at)
        name = data[at + 8:at + 8 + k].decode()
        at += 8 + k
        out.append((name, *struct.unpack_from("<QQQ", data, at)))
        at += 24
    return size, out


def replace_part(data: bytes, index: int, payload: bytes) -> bytes:
    """The sidecar with part `index`'s bytes replaced and its checksum written for them (a consistent file)."""
    p = parts(data)[index]
    return (data[:p.at] + struct.pack("<QQ", len(payload), hash64(payload)) + payload +
            data[p.payload + p.length:])


def as_version_3(data: bytes) -> bytes:
    """A format-4 sidecar written as format 3 was: its parts' bytes one after another, unframed, without the KV
    state record."""
    ps = parts(data)
    return b"SQZP" + struct.pack("<I", 3) + b"".join(data[p.payload:p.payload + p.length] for p in ps[:-1])


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]


def overwrite_middle(data: bytes, n: int = 4096, seed: int = 0) -> bytes:
    """n bytes in the middle of data overwritten with other bytes."""
    import random
    rng = random.Random(seed)
    at = len(data) // 2 - n // 2
    noise = bytes(b ^ rng.randrange(1, 256) for b in data[at:at + n])
    return data[:at] + noise + data[at + n:]
