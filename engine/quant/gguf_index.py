"""A GGUF file's tensor index, parsed once per file version, and its tensors memory-mapped one
at a time.

Why not `gguf.GGUFReader`: it turns every metadata value into numpy views, and the default
model's tokenizer (49152 tokens and their merges) made that 33 s per reader on the 2-core VM
(three readers per load: 133 s of a 134 s load). Here the metadata is skipped with `struct`
(only general.architecture and general.alignment are kept), the tensor infos are read, and each
tensor's bytes are mapped only while it is being read: a mapping held across the load would
count every page read into the peak RSS.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata (key string, u32 type, value); tensor infos (name string, u32 n_dims, u64 dims
innermost first, u32 type, u64 offset); data from the next multiple of the alignment. Strings
are a u64 length and the bytes.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_WIDE_TYPES = {"F32": np.float32, "F16": np.float16}  # mapped as values, the rest as bytes


class BlockType(enum.IntEnum):
    """The GGML block types known here without the gguf package (ids and names as in its
    `GGMLQuantizationType`): the ones the loader reads itself. Importing gguf brings its
    writer, yaml and its tensor-name tables along, 2.8 MiB of RSS for good, so a file of
    these types never imports it; any other type is looked up in gguf's own table (and
    dequantized by gguf)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8


# (elements, bytes) per block
_BLOCK_SIZES = {
    BlockType.F32: (1, 4), BlockType.F16: (1, 2), BlockType.Q4_0: (32, 18),
    BlockType.Q4_1: (32, 20), BlockType.Q8_0: (32, 34),
}  # fmt: skip


def block_type(type_id: int) -> enum.IntEnum:
    """`BlockType`, or gguf's `GGMLQuantizationType` for the types it alone knows."""
    try:
        return BlockType(type_id)
    except ValueError:
        pass
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(type_id)  # ValueError: a type nobody knows


def block_sizes(tensor_type: enum.IntEnum) -> tuple[int, int]:
    """(elements, bytes) of one block of `tensor_type`."""
    if tensor_type in _BLOCK_SIZES:
        return _BLOCK_SIZES[tensor_type]
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[tensor_type]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: enum.IntEnum  # BlockType or gguf's GGMLQuantizationType (same ids, names)
    dims: tuple[int, ...]  # innermost first, as in the file
    offset: int  # from the file's start

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims))

    @property
    def data(self) -> np.ndarray:
        """The tensor as GGUFReader gives it: F32/F16 values [.., rows, cols], other types uint8
        blocks [rows, bytes per row]; memory-mapped until dropped."""
        rows = tuple(reversed(self.dims))
        wide = _WIDE_TYPES.get(self.tensor_type.name)
        if wide is not None:
            return np.memmap(self._path, wide, "r", self.offset, rows)
        block_size, type_size = block_sizes(self.tensor_type)
        shape = (*rows[:-1], rows[-1] // block_size * type_size)
        return np.memmap(self._path, np.uint8, "r", self.offset, shape)


class GGUFIndex:
    def __init__(self, path: Path, architecture: str, tensors: list[TensorInfo]):
        self.path, self.architecture, self.tensors = path, architecture, tensors


def read_index(path: Path) -> GGUFIndex:
    """The index of `path` (cached per path, size and modification time)."""
    stat = Path(path).stat()
    return _read_index(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_index(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    with open(path, "rb") as handle:
        header = handle.read(24)
        if len(header) < 24 or header[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, num_tensors, num_kv = struct.unpack_from("<IQQ", header, 4)
        reader = _Reader(handle, 24, size)
        metadata = {}
        for _ in range(num_kv):
            key = reader.string()
            value = reader.value(reader.unpack("I"))
            if key in ("general.architecture", "general.alignment"):
                metadata[key] = value
        infos = []
        for _ in range(num_tensors):
            name = reader.string()
            num_dims = reader.unpack("I")
            dims = tuple(reader.unpack("Q") for _ in range(num_dims))
            infos.append((name, reader.unpack("I"), dims, reader.unpack("Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-reader.offset // alignment) * alignment
    tensors = []
    for name, type_id, dims, offset in infos:
        try:
            tensor_type = block_type(type_id)
        except ValueError as error:
            raise ValueError(f"GGUF tensor {name!r} has an unknown type id {type_id}") from error
        info = TensorInfo(name, tensor_type, dims, data_start + offset)
        _check_extent(info, size)
        object.__setattr__(info, "_path", path)
        tensors.append(info)
    return GGUFIndex(Path(path), str(metadata.get("general.architecture", "")), tensors)


def _check_extent(info: TensorInfo, file_size: int) -> None:
    """A clear error for a tensor whose shape or position does not fit in the file (a damaged
    header), before numpy is asked to map it (it overflows on absurd sizes)."""
    block_size, type_size = block_sizes(info.tensor_type)
    n_elements = 1
    for dim in info.dims:
        n_elements *= dim  # Python ints: no overflow, however damaged
    num_bytes = n_elements // block_size * type_size
    if not info.dims or n_elements % block_size or info.offset + num_bytes > file_size:
        raise ValueError(
            f"GGUF tensor {info.name!r} ({info.tensor_type.name} {list(info.dims)} at byte "
            f"{info.offset}) does not fit in the file's {file_size} bytes: damaged or truncated?"
        )


class _Reader:
    """Sequential little-endian reads through a buffered file."""

    def __init__(self, handle, offset: int, size: int):
        self.handle, self.offset, self.size = handle, offset, size

    def read(self, num_bytes: int) -> bytes:
        if num_bytes > self.size - self.offset:  # a corrupt length: never allocate for it
            raise ValueError("GGUF file ends inside its header")
        data = self.handle.read(num_bytes)
        if len(data) != num_bytes:
            raise ValueError("GGUF file ends inside its header")
        self.offset += num_bytes
        return data

    def unpack(self, code: str):
        return struct.unpack("<" + code, self.read(struct.calcsize(code)))[0]

    def string(self) -> str:
        return self.read(self.unpack("Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALARS:  # skipped in one read: no value is kept
                self.read(count * struct.calcsize(_SCALARS[item_type]))
                return None
            for _ in range(count):
                self.value(item_type)
            return None
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF metadata has an unknown value type {value_type}")
        return self.unpack(_SCALARS[value_type])
