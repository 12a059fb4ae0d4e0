"""Reading a GGUF file's header: key/value metadata and tensor descriptors, over one memory map.

``gguf.GGUFReader`` gives the same values but builds a numpy view for each of the ~100k vocabulary
and merge strings of a tokenizer (8 s for SmolLM2 here, on every open); reading the header with
``struct`` takes 0.1 s. Dequantization stays with the ``gguf`` package (``gguf.quants``).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from myserve.errors import CheckpointError

# GGUF metadata value types with a fixed width, as struct codes (8 is string, 9 is array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's descriptor: ggml dims (fastest first), ggml type id, and its raw bytes."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    data: np.ndarray  # uint8 view into the file's memory map

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy shape (ggml dims reversed)."""
        return tuple(reversed(self.dims))


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF header; tensor bytes stay in the memory map until dequantized."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, n = self.unpack("IQ")
        if etype in _SCALARS:
            return list(self.unpack(f"{n}{_SCALARS[etype]}"))
        return [self.value(etype) for _ in range(n)]


def read_gguf(path: Path, *, with_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF v2/v3 (little-endian) header; one-line ``CheckpointError`` if it is not one."""
    import gguf  # for the block sizes of the ggml types

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(buf, 0)
        magic, version, n_tensors, n_kv = cur.unpack("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"magic {magic!r}, version {version}; expected GGUF v2 or v3")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            metadata[key] = cur.value(vtype)
        tensors: dict[str, GGUFTensorInfo] = {}
        if with_tensors:
            descriptors = []
            for _ in range(n_tensors):
                name = cur.string()
                (n_dims,) = cur.unpack("I")
                dims = cur.unpack(f"{n_dims}Q")
                ggml_type, offset = cur.unpack("IQ")
                descriptors.append((name, dims, ggml_type, offset))
            align = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
            start = -(-cur.pos // align) * align
            raw = np.frombuffer(buf, dtype=np.uint8)
            for name, dims, ggml_type, offset in descriptors:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
                row_bytes = dims[0] // block * type_size
                n_rows = int(np.prod(dims[1:], dtype=np.int64))
                data = raw[start + offset : start + offset + row_bytes * n_rows]
                if data.size != row_bytes * n_rows:
                    raise ValueError(f"tensor {name} runs past the end of the file")
                shape = (*reversed(dims[1:]), row_bytes)
                tensors[name] = GGUFTensorInfo(name, tuple(dims), ggml_type, data.reshape(shape))
        return GGUFFile(path, metadata, tensors)
    except (OSError, ValueError, KeyError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
