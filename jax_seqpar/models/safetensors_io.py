"""Streamed reading and writing of safetensors files, one tensor at a time.

The safetensors format (huggingface/safetensors, "Format"): 8 bytes little-endian header
length ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {str: str}}``, then the tensors' bytes (C order, little-endian),
offsets counted from the end of the header.

Reading maps one tensor's bytes with ``np.memmap`` and copies out only the slice asked
for; the map is dropped after each tensor, so the pages of the file that a load touched
leave the process's resident set as it goes.  (safetensors' own NumPy reader cannot return
bfloat16 -- NumPy has no such dtype: ``TypeError: data type 'bfloat16' not understood`` --
and its JAX reader puts every slice on the default device first; ``ml_dtypes`` gives NumPy
the bfloat16 / float8 dtypes here.)  Writing puts the header first (it needs only shapes
and dtypes) and then each tensor as it is produced, so no more than one tensor is held.
Files written here are read by ``safetensors.safe_open`` and ``safetensors.numpy``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
          "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
CODES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 * 2 ** 20


class TensorInfo(NamedTuple):
    """Where one tensor lies: file, dtype code, shape, absolute byte offset, byte count."""
    file: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """``({name: TensorInfo}, metadata)`` of one safetensors file; a ``ValueError`` names
    the file and the tensor when the header is malformed."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} is not plausible (file {size} B)")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: the header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    infos = {}
    for name, h in header.items():
        if h.get("dtype") not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {h.get('dtype')!r}; "
                             f"supported: {sorted(DTYPES)}")
        begin, end = h["data_offsets"]
        shape = tuple(int(d) for d in h["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[h["dtype"]].itemsize
        if end - begin != nbytes or 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name} ({h['dtype']} {list(shape)}) has "
                             f"data_offsets {[begin, end]} that do not fit its size or "
                             f"the file")
        infos[name] = TensorInfo(path, h["dtype"], shape, 8 + n + begin, nbytes)
    return infos, meta


def read_slice(info: TensorInfo, view: Optional[Sequence[int]] = None, index=()) -> np.ndarray:
    """A copy of ``tensor.reshape(view)[index]`` (``view=None``: the stored shape), read
    through a memory map of that tensor only."""
    dtype = DTYPES[info.dtype]
    shape = tuple(view) if view is not None else info.shape
    if info.nbytes == 0:
        return np.empty(shape, dtype)[index]
    mm = np.memmap(info.file, dtype=dtype, mode="r", offset=info.offset, shape=info.shape)
    try:
        return np.array(mm.reshape(shape)[index], copy=True)
    finally:
        del mm


def _pad8(header: bytes) -> bytes:
    return header + b" " * (-len(header) % 8)


def write_file(path: str, entries: Sequence[Tuple[str, np.dtype, Tuple[int, ...]]],
               produce: Callable[[str], np.ndarray],
               metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``entries`` (name, dtype, shape), in order, to ``path``: the header first,
    then ``produce(name)`` for each tensor, written as soon as it comes (to ``path +
    '.tmp'``, renamed when complete)."""
    header, pos = {}, 0
    for name, dtype, shape in entries:
        dtype = np.dtype(dtype)
        if dtype not in CODES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot be stored; supported: "
                             f"{sorted(str(d) for d in CODES)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if metadata:
        header = {"__metadata__": dict(metadata), **header}
    raw = _pad8(json.dumps(header, separators=(",", ":")).encode())
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in entries:
            arr = produce(name)
            if arr.dtype != np.dtype(dtype) or tuple(arr.shape) != tuple(shape):
                raise ValueError(f"tensor {name}: produced {arr.dtype} {arr.shape}, "
                                 f"expected {np.dtype(dtype)} {tuple(shape)}")
            np.ascontiguousarray(arr).tofile(f)
            del arr
    os.replace(tmp, path)


def parse_size(size) -> int:
    """``"5GB"`` (10**9), ``"500MiB"`` (2**20), ``"100KB"``, or an int of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size={size} must be positive")
        return size
    units = {"TIB": 2 ** 40, "GIB": 2 ** 30, "MIB": 2 ** 20, "KIB": 2 ** 10, "TB": 10 ** 12,
             "GB": 10 ** 9, "MB": 10 ** 6, "KB": 10 ** 3, "B": 1}
    s = str(size).strip().upper()
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[:-len(unit)]) * mult)
            except ValueError:
                break
    raise ValueError(f"max_shard_size={size!r}: give bytes (int) or e.g. '5GB', '500MiB'")


def plan_shards(sizes: Iterable[Tuple[str, int]], max_bytes: int):
    """Consecutive groups of tensors, each at most ``max_bytes`` unless one tensor alone
    is larger (as transformers does)."""
    groups, cur, cur_bytes = [], [], 0
    for name, nbytes in sizes:
        if cur and cur_bytes + nbytes > max_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nbytes
    if cur:
        groups.append(cur)
    return groups


__all__ = ["DTYPES", "TensorInfo", "parse_size", "plan_shards", "read_header", "read_slice",
           "write_file"]
