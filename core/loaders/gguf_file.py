"""A lean GGUF reader: metadata, tensor table and memory-mapped tensor bytes.

Why not `gguf.GGUFReader`: it materializes a numpy view per array element, which for a
49k-token vocabulary plus its merge table costs seconds of pure Python before any weight is
touched. Here metadata is parsed with `struct` once, string arrays are only
decoded when asked for (the tokenizer needs them), and tensor data stays in the mmap until
dequantized. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Container, Optional

import numpy as np

from tokenmill.quantization.gguf import qtype_name, stored_nbytes

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# metadata value type -> (struct format, width); 8 = string and 9 = array are variable-size
_SCALAR = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
           6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
              6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]     # torch order (outermost first): the reverse of GGUF's `ne`
    qtype: int                 # ggml type id
    offset: int                # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """One GGUF file. `metadata` maps keys to Python values; numeric arrays are lists,
    string arrays are lists of str when their key is in `string_arrays`, else their length."""

    def __init__(self, path: str, string_arrays: Container[str] = ("tokenizer.ggml.tokens",
                                                                 "tokenizer.ggml.merges")) -> None:
        self.path = path
        self._blob = np.memmap(path, mode="r", dtype=np.uint8)
        # Parse through a memoryview: slicing it is far cheaper than slicing the memmap per string.
        blob = memoryview(self._blob)
        if bytes(blob[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported "
                             f"(supported: {list(_SUPPORTED_VERSIONS)})")
        self.version = version
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_str(blob, pos)
            (vtype,) = struct.unpack_from("<I", blob, pos)
            self.metadata[key], pos = _read_value(blob, pos + 4, vtype, key in string_arrays)
        infos = []
        for _ in range(tensor_count):
            name, pos = _read_str(blob, pos)
            (n_dims,) = struct.unpack_from("<I", blob, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
            pos += 4 + 8 * n_dims
            qtype, rel_offset = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            infos.append((name, tuple(reversed(dims)), qtype, rel_offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, rel_offset in infos:
            count = int(np.prod(shape)) if shape else 1
            try:
                nbytes = stored_nbytes(qtype, count)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}: tensor {name!r} has unsupported type {qtype_name(qtype)}") from exc
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + rel_offset, nbytes)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not arch:
            raise ValueError(f"{self.path} has no general.architecture metadata")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor: a read-only view into the memory map."""
        info = self.tensors[name]
        return self._blob[info.offset:info.offset + info.nbytes]

    def read_string_array(self, key: str) -> Optional[list[str]]:
        """Re-read one string array in full (for keys not decoded at open)."""
        value = self.metadata.get(key)
        if isinstance(value, list) or value is None:
            return value
        return GGUFFile(self.path, string_arrays=(key,)).metadata[key]


def _read_str(blob: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    pos += 8
    return bytes(blob[pos:pos + length]).decode("utf-8", errors="replace"), pos + length


def _read_value(blob: memoryview, pos: int, vtype: int, keep_strings: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt, width = _SCALAR[vtype]
        return struct.unpack_from(fmt, blob, pos)[0], pos + width
    if vtype == _STRING:
        return _read_str(blob, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if etype in _NP_SCALAR:
        width = _SCALAR[etype][1]
        # As plain lists, like every other GGUF consumer (transformers' tokenizer builders) expects.
        values = np.frombuffer(blob, dtype=_NP_SCALAR[etype], count=count, offset=pos).tolist()
        return values, pos + count * width
    if etype == _STRING:
        if keep_strings:
            out = []
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", blob, pos)
                pos += 8
                out.append(bytes(blob[pos:pos + length]).decode("utf-8", errors="replace"))
                pos += length
            return out, pos
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + length
        return count, pos
    if etype == _ARRAY:
        values = []
        for _ in range(count):
            (inner_type,) = struct.unpack_from("<I", blob, pos)
            value, pos = _read_value(blob, pos + 4, inner_type, keep_strings)
            values.append(value)
        return values, pos
    raise ValueError(f"unknown GGUF array element type {etype}")
