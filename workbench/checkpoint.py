"""Safetensors checkpoints in and out: read (single, sharded, or loose files), load into a
module by name, save (optionally sharded), and the name maps for our two models.

Weights are safetensors only: a pickle (`.bin`, `.pt`) can run code when opened, so it is
refused, never opened. Loading checks everything nanoGPT's `from_pretrained` checks (key
sets, shapes) before any tensor is assigned, so a bad checkpoint fails whole, not halfway,
and every error names the file, the tensor and what was expected.

FP8 checkpoints (DeepSeek-V3, Kimi-K2) store `X.weight` as float8_e4m3fn plus
`X.weight_scale_inv`, one fp32 scale per 128x128 block; the reader dequantises on `get`.
Kimi-K2.5/K2.6 store their routed experts in compressed-tensors' `pack-quantized` format
(`X.weight_packed` int32, `X.weight_scale`, `X.weight_shape`, `X.weight_zero_point` when
asymmetric); the reader shows them as one `X.weight` and dequantises on `get`, with the group
size and symmetry its `quantization_config` gives. A scheme it does not handle is an error
naming the scheme, the tensor and the file, raised when the reader opens the checkpoint.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` holds the block scales of fp8 `X.weight`
FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Kimi-K2 quantisation block (rows, cols)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# safetensors header dtype codes -> torch dtypes (codes we can load into a module).
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the model needs; the message names file and tensor."""


def _file_error(path: Path, err: Exception) -> CheckpointError:
    """Explain why safetensors refused a file; a short file gets the byte counts it is missing."""
    size = path.stat().st_size
    why = f"not a valid safetensors file ({err})"
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            why = f"truncated: its header needs {8 + n + end} bytes, the file has {size}"
    except Exception:  # the header itself is unreadable; safetensors' own reason stands
        pass
    return CheckpointError(f"{path}: {why}; expected a complete safetensors file")


def _scale_name(name: str) -> str | None:
    return name + SCALE_SUFFIX if name.endswith(".weight") else None


# ---- compressed-tensors pack-quantized ------------------------------------------------------

PACKED_SUFFIX = ".weight_packed"
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
PACK_FORMAT = "pack-quantized"
# Whether a tensor looks quantised, for naming one when the config's scheme is not handled.
_QUANT_HINTS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                "weight_scale_inv", "SCB", "absmax", "quant_map", "input_scale")


@dataclass(frozen=True)
class IntScheme:
    """One compressed-tensors weight scheme the loader dequantises (`quantization_config.config_groups.*`)."""

    group: str  # the config group's name, for messages
    num_bits: int
    strategy: str  # "group": a scale per `group_size` inputs of a row; "channel": one per row
    group_size: int | None
    symmetric: bool  # asymmetric weights carry a packed `weight_zero_point`

    def describe(self) -> str:
        per = f"group_size {self.group_size}" if self.strategy == "group" else "per channel"
        return f"int{self.num_bits} {per}, {'symmetric' if self.symmetric else 'asymmetric'}"


def quant_method(quantization: dict | None) -> str | None:
    """`quantization_config.quant_method`, normalised as vLLM does (compressed_tensors -> compressed-tensors)."""
    if not quantization:
        return None
    return str(quantization.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: "re:" targets are `re.match`ed, others name a module or a class
    (every packed tensor is a Linear's weight). A wrapper's "language_model." may be left out."""
    names = (module, module.removeprefix(TEXT_PREFIX))
    if target.startswith("re:"):
        return any(re.match(target[3:], n) for n in names)
    return target == "Linear" or target in names


def int_scheme_for(module: str, quantization: dict, where: str) -> IntScheme:
    """The scheme `quantization_config` gives the packed weight of `module`, or a CheckpointError
    naming the scheme, the tensor and `where` (its file) if the loader cannot dequantise it."""
    tensor = f"'{module}{PACKED_SUFFIX}' (in {where})"
    if any(_matches(module, t) for t in quantization.get("ignore") or []):
        raise CheckpointError(f"{where}: tensor '{module}{PACKED_SUFFIX}' is packed, but quantization_config.ignore "
                              f"lists module '{module}'; expected only quantised modules to be packed")
    groups = quantization.get("config_groups") or {}
    name, group = next(((n, g) for n, g in groups.items()
                        if any(_matches(module, t) for t in (g or {}).get("targets") or [])), (None, None))
    if group is None:
        raise CheckpointError(f"{where}: tensor '{module}{PACKED_SUFFIX}' is packed, but no "
                              f"quantization_config.config_groups entry targets module '{module}'; expected one")
    w = group.get("weights") or {}
    fmt = group.get("format") or quantization.get("format")
    scheme = (f"quantization_config.config_groups.{name} (format {fmt!r}, type {w.get('type')!r}, num_bits "
              f"{w.get('num_bits')!r}, strategy {w.get('strategy')!r}, actorder {w.get('actorder')!r}, "
              f"dynamic {w.get('dynamic')!r})")
    bits, size = w.get("num_bits"), w.get("group_size")
    ok = (fmt == PACK_FORMAT and w.get("type") == "int" and bits in (1, 2, 4, 8)
          and w.get("strategy") in ("group", "channel") and w.get("actorder") in (None, "static")
          and not w.get("dynamic") and (w.get("strategy") == "channel" or isinstance(size, int) and size > 0))
    if not ok:
        raise CheckpointError(f"{where}: tensor {tensor} is quantised by {scheme}, which the loader does not "
                              f"handle; expected '{PACK_FORMAT}' int weights of 1, 2, 4 or 8 bits with strategy "
                              f"'group' (a positive group_size) or 'channel', static order, not dynamic")
    return IntScheme(name, bits, w["strategy"], size if w["strategy"] == "group" else None,
                     bool(w.get("symmetric", True)))


def packed_weight_shape(module: str, shapes: dict[str, tuple[int, ...]], scheme: IntScheme,
                        where: str) -> tuple[int, int]:
    """[out, in] of `module`'s packed weight from the stored shapes alone (exact for the group
    strategy; per channel the packing pads `in` up to a whole word, so it is an upper bound that
    `weight_shape` settles). Every part's shape is checked against the scheme."""
    parts = {p: shapes.get(f"{module}.{p}") for p in PACKED_PARTS}
    for p in ("weight_scale", "weight_shape") + (() if scheme.symmetric else ("weight_zero_point",)):
        if parts[p] is None:
            raise CheckpointError(f"{where}: tensor '{module}.{p}' is missing beside '{module}{PACKED_SUFFIX}'; "
                                  f"expected it for {scheme.describe()} (quantization_config.config_groups."
                                  f"{scheme.group})")
    if scheme.symmetric and parts["weight_zero_point"] is not None:
        raise CheckpointError(f"{where}: tensor '{module}.weight_zero_point' is stored for a symmetric scheme "
                              f"(config_groups.{scheme.group}); expected none, or 'symmetric': false")
    per = 32 // scheme.num_bits
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    if len(packed) != 2 or len(scale) != 2 or scale[0] != packed[0] or parts["weight_shape"] != (2,):
        raise CheckpointError(f"{where}: tensors '{module}.weight_packed' {packed}, '.weight_scale' {scale}, "
                              f"'.weight_shape' {parts['weight_shape']}; expected [out, words], [out, groups], [2]")
    grouped = scheme.strategy == "group"
    cols = scale[1] * scheme.group_size if grouped else packed[1] * per
    if math.ceil(cols / per) != packed[1] or scale != (scale if grouped else (packed[0], 1)):
        per_row = f"[out, in / {scheme.group_size}]" if grouped else "[out, 1]"
        raise CheckpointError(f"{where}: tensor '{module}.weight_packed' has shape {packed} and '.weight_scale' "
                              f"{scale}; expected [out, ceil(in / {per})] and {per_row} for {scheme.describe()}")
    if not scheme.symmetric and parts["weight_zero_point"] != (math.ceil(packed[0] / per), scale[1]):
        raise CheckpointError(f"{where}: tensor '{module}.weight_zero_point' has shape {parts['weight_zero_point']}; "
                              f"expected {(math.ceil(packed[0] / per), scale[1])} (packed along the rows)")
    return packed[0], cols


def logical_layout(stored: dict[str, tuple[int, ...]], quantization: dict | None = None,
                   where: str = "checkpoint") -> dict[str, tuple[int, ...]]:
    """The tensors `SafetensorsReader.keys()` shows for stored `{name: shape}` (a header, or a
    published tensor listing), with their shapes: each packed triplet as one `X.weight` [out, in],
    fp8 block scales folded into their weight (checked against `weight_block_size`)."""
    method = quant_method(quantization)
    block = tuple((quantization or {}).get("weight_block_size") or FP8_BLOCK)
    out, parts = {}, set()
    if method == "compressed-tensors":
        for module in (n.removesuffix(PACKED_SUFFIX) for n in stored if n.endswith(PACKED_SUFFIX)):
            scheme = int_scheme_for(module, quantization, where)
            out[module + ".weight"] = packed_weight_shape(module, stored, scheme, where)
            parts |= {f"{module}.{p}" for p in PACKED_PARTS}
    for name, shape in stored.items():
        if name in parts:
            continue
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            want = tuple(math.ceil(d / b) for d, b in zip(stored.get(weight, ()), block))
            if weight not in stored or tuple(shape) != want:
                raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(shape)}; expected {want} for "
                                      f"weight '{weight}' of shape {stored.get(weight)} in {block} blocks")
            continue
        out[name] = tuple(shape)
    return out


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Signed ints (int8) from int32 words along `dim`: each word holds 32 // num_bits values, the
    first in the lowest bits, each stored as value + 2^(num_bits - 1) (compressed-tensors'
    `pack_to_int32`); `length` values are kept of that dim (the last word may be padding)."""
    if packed.dtype != torch.int32 or num_bits not in (1, 2, 4, 8):
        raise ValueError(f"packed is {packed.dtype} with num_bits {num_bits}; expected int32 and 1, 2, 4 or 8 bits")
    words = packed.transpose(0, 1) if dim == 0 else packed
    per = 32 // num_bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * num_bits
    values = (words[..., None] >> shifts) & ((1 << num_bits) - 1)  # the mask undoes the sign-extending shift
    values = (values.flatten(-2)[:, :length] - (1 << (num_bits - 1))).to(torch.int8)
    return values.transpose(0, 1) if dim == 0 else values


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], num_bits: int,
                      group_size: int | None = None, zero_point: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero_point) * scale per group of `group_size` inputs (None: one group per row), in fp32.

    q and the zero point are small integers, so each product is exact in fp32 and rounds once
    to `dtype`: the same numbers compressed-tensors' decompress gives in the scale's dtype.
    """
    rows, cols = shape
    size = group_size or cols
    if cols % size or tuple(scale.shape) != (rows, cols // size):
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {(rows, cols // size)} for a {shape} "
                         f"weight in groups of {size}")
    q = unpack_int32(packed, num_bits, cols).float().view(rows, cols // size, size)
    if zero_point is not None:
        q = q - unpack_int32(zero_point, num_bits, rows, dim=0).float()[:, :, None]
    return (q * scale.float()[:, :, None]).view(rows, cols).to(dtype)


class SafetensorsReader:
    """A checkpoint directory's tensors, memory-mapped: single `model.safetensors`, sharded via
    `model.safetensors.index.json` (weight_map), or (fallback) every `*.safetensors` in the dir.

    Files are opened once, up front, so a corrupt or missing file fails at construction rather
    than in the middle of a load. `*_scale_inv` tensors are hidden from `keys()` because they
    are folded into their fp8 weight by `get`; `get` still returns them by exact name.
    `quantization` is the checkpoint's `quantization_config` (`config_source` names its file):
    with compressed-tensors, each packed triplet shows as one `X.weight` (see `PACKED_PARTS`).
    """

    def __init__(self, directory: str | Path, quantization: dict | None = None,
                 config_source: str | None = None):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory; expected a checkpoint directory")
        self.index_path: Path | None = None
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._names: dict[Path, set[str]] = {}  # tensor names per file, read once
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if single.is_file():
            self._add_file(single)
        elif index.is_file():
            self._read_index(index)
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise self._nothing_found()
            for path in files:
                self._add_file(path)
        self.fp8_block = FP8_BLOCK
        self._packed: dict[str, tuple[str, IntScheme, tuple[int, int]]] = {}  # X.weight -> (X, scheme, shape)
        self._plan_quantization(quantization, config_source or str(self.directory / "config.json"))

    def _plan_quantization(self, quantization: dict | None, source: str) -> None:
        """Check the scheme against the stored tensors now, so an unhandled one fails before any load."""
        method = quant_method(quantization)
        packed = [n.removesuffix(PACKED_SUFFIX) for n in self._where if n.endswith(PACKED_SUFFIX)]
        if method == "fp8":
            block = quantization.get("weight_block_size") or FP8_BLOCK
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                                 for b in block)):
                raise CheckpointError(f"{source}: field 'quantization_config.weight_block_size' = {block!r}; "
                                      f"expected [rows, cols] of an FP8 scale block")
            self.fp8_block = tuple(block)
        elif method not in (None, "compressed-tensors"):
            hint = next((n for n in self._where if n.rsplit(".", 1)[-1] in _QUANT_HINTS), None)
            found = f"; first quantised tensor '{hint}' in {self._where[hint]}" if hint else ""
            raise CheckpointError(f"{source}: quantization_config.quant_method = {method!r} is not handled{found}; "
                                  f"expected 'fp8' (block scales) or 'compressed-tensors' ({PACK_FORMAT} int)")
        if packed and method != "compressed-tensors":
            raise CheckpointError(f"{self._where[packed[0] + PACKED_SUFFIX]}: tensor '{packed[0]}{PACKED_SUFFIX}' is "
                                  f"packed, but {source} has no compressed-tensors quantization_config; expected one "
                                  f"naming its scheme")
        if method == "compressed-tensors":
            self._plan_packed(quantization, packed)

    def _plan_packed(self, quantization: dict, packed: list[str]) -> None:
        shapes = {n: self.shape(n) for n in self._where if n.rsplit(".", 1)[-1] in PACKED_PARTS}
        for module in packed:
            where = str(self._where[module + PACKED_SUFFIX])
            if module + ".weight" in self._where:
                raise CheckpointError(f"{where}: module '{module}' stores both 'weight' and 'weight_packed'; "
                                      f"expected one")
            scheme = int_scheme_for(module, quantization, where)
            self._packed[module + ".weight"] = (module, scheme, packed_weight_shape(module, shapes, scheme, where))
        for name in shapes:  # a scale or zero point with no packed weight: another compressed-tensors format
            module, _, part = name.rpartition(".")
            if module + ".weight" not in self._packed:
                fmt = quantization.get("format")
                raise CheckpointError(f"{self._where[name]}: tensor '{name}' has no '{module}{PACKED_SUFFIX}' beside "
                                      f"it: compressed-tensors format {fmt!r} stores it, which the loader does not "
                                      f"handle; expected '{PACK_FORMAT}'")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # SafetensorError carries no useful subclass
                raise _file_error(path, err) from err
            self._names[path] = set(self._handles[path].keys())
        return self._handles[path]

    def _add_file(self, path: Path) -> None:
        self._open(path)
        for name in sorted(self._names[path]):
            if name in self._where:
                raise CheckpointError(
                    f"tensor '{name}' is stored twice: in {self._where[name]} and in {path}; "
                    f"expected each tensor in exactly one file")
            self._where[name] = path

    def _read_index(self, index: Path) -> None:
        self.index_path = index
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index}: unreadable ({err!r}); expected JSON with a 'weight_map' object") from err
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' is empty or not an object; "
                                  f"expected {{tensor name: shard file}}")
        for name, shard in weight_map.items():
            path = self.directory / str(shard)
            if not path.is_file():
                raise CheckpointError(f"{index}: shard '{shard}' (holding tensor '{name}') "
                                      f"does not exist; expected the file {path}")
            self._open(path)
            if name not in self._names[path]:
                raise CheckpointError(f"{index}: tensor '{name}' is mapped to {path}, "
                                      f"which does not contain it")
            self._where[name] = path

    def _nothing_found(self) -> CheckpointError:
        pickles = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        msg = (f"{self.directory}: no safetensors weights; expected {SINGLE_FILE}, "
               f"{INDEX_FILE} or *.safetensors")
        if pickles:
            msg += (f". Found pickle file(s) {pickles}: refused, never opened (unpickling can run "
                    f"code); convert them to safetensors with a trusted tool")
        return CheckpointError(msg)

    def _describe(self) -> str:
        return str(self.index_path or self.directory)

    def keys(self) -> list[str]:
        parts = {f"{m}.{p}" for m, _, _ in self._packed.values() for p in PACKED_PARTS}
        return [n for n in self._where if not n.endswith(SCALE_SUFFIX) and n not in parts] + list(self._packed)

    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self._packed

    def file_of(self, name: str) -> str:
        if name in self._packed:
            return str(self._where[self._packed[name][0] + PACKED_SUFFIX])
        if name not in self._where:
            near = difflib.get_close_matches(name, self._where, n=3)
            raise CheckpointError(f"{self._describe()}: no tensor '{name}'"
                                  + (f"; did you mean {near}?" if near else ""))
        return str(self._where[name])

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._packed:
            module, scheme, shape = self._packed[name]
            if scheme.strategy == "channel":  # the packing pads a row to whole words: weight_shape is exact
                shape = tuple(self._packed_true_shape(module, shape))
            return shape
        return tuple(self._open(Path(self.file_of(name))).get_slice(name).get_shape())

    def _packed_true_shape(self, module: str, shape: tuple[int, int]) -> tuple[int, int]:
        stored = tuple(int(v) for v in self.get(module + ".weight_shape").tolist())
        per = 32 // self._packed[module + ".weight"][1].num_bits
        if len(stored) != 2 or stored[0] != shape[0] or not shape[1] - per < stored[1] <= shape[1]:
            raise CheckpointError(f"{self.file_of(module + '.weight_shape')}: tensor '{module}.weight_shape' = "
                                  f"{list(stored)}; expected [out, in] = {list(shape)} from its packed weight")
        return stored

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype (fp8 weights report fp8 even though `get` dequantises them; packed ones,
        their scales' dtype)."""
        if name in self._packed:
            name = self._packed[name][0] + ".weight_scale"
        path = self.file_of(name)
        code = self._open(Path(path)).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {code}; "
                                  f"expected one of {sorted(_DTYPES)}")
        return _DTYPES[code]

    def get(self, name: str, dtype: torch.dtype | None = None,
            device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor, on `device`, cast to `dtype` (default: as stored; float32 for fp8 with
        block scales, which are applied first so no precision is lost before the cast; likewise
        packed int weights)."""
        if name in self._packed:
            return self._get_packed(name, dtype, device)
        path = self.file_of(name)
        try:
            t = self._open(Path(path)).get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({err})") from err
        scale = _scale_name(name)
        if scale is None or scale not in self._where:
            return t.to(device=device, dtype=dtype or t.dtype)
        s = self.get(scale)
        if t.dtype not in _FP8:
            raise CheckpointError(f"{path}: tensor '{name}' is {t.dtype} but has block scales "
                                  f"'{scale}'; expected a float8 weight")
        want = tuple(math.ceil(d / b) for d, b in zip(t.shape, self.fp8_block))
        if t.dim() != 2 or tuple(s.shape) != want:
            raise CheckpointError(f"{self.file_of(scale)}: tensor '{scale}' has shape "
                                  f"{tuple(s.shape)}; expected {want} for weight '{name}' "
                                  f"of shape {tuple(t.shape)} in {self.fp8_block} blocks")
        return dequantize_fp8_blocks(t.to(device), s.to(device), self.fp8_block, dtype or torch.float32)

    def _get_packed(self, name: str, dtype: torch.dtype | None, device) -> torch.Tensor:
        module, scheme, shape = self._packed[name]
        shape = self._packed_true_shape(module, shape)
        part = {p: self.get(f"{module}.{p}", device=device) for p in PACKED_PARTS if f"{module}.{p}" in self._where}
        return dequantize_packed(part["weight_packed"], part["weight_scale"], shape, scheme.num_bits,
                                 scheme.group_size, part.get("weight_zero_point"), dtype or torch.float32)


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = FP8_BLOCK,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w[i, j] * scale_inv[i // block[0], j // block[1]] in fp32, then cast to `dtype`.

    Works one block-row at a time, so the only full-size tensor made is the result (a whole
    expanded scale would double peak memory on a 7168x18432 weight). Edge blocks may be
    partial: the scale is expanded and then cropped to the weight's width.
    """
    if w.dim() != 2:
        raise ValueError(f"weight has shape {tuple(w.shape)}; expected a 2-D [out, in] matrix")
    rows, cols = w.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}; expected {want} "
                         f"for a {tuple(w.shape)} weight in {block} blocks")
    out = torch.empty(rows, cols, dtype=dtype, device=w.device)
    scale = scale_inv.to(torch.float32)
    for bi in range(want[0]):
        r0, r1 = bi * block[0], min((bi + 1) * block[0], rows)
        row_scale = scale[bi].repeat_interleave(block[1])[:cols]
        out[r0:r1] = (w[r0:r1].to(torch.float32) * row_scale).to(dtype)
    return out


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by full name, tied aliases included."""
    found = dict(module.named_parameters(remove_duplicate=False))
    for name, buf in module.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            found[name] = buf
    return found


def _listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _match_names(reader: SafetensorsReader, targets: dict[str, torch.Tensor],
                 rename: Callable[[str], str | None] | None,
                 ignore: Callable[[str], bool] | None, owner: str) -> dict[str, str]:
    """Module name -> checkpoint name; refuses unexpected names and two names on one tensor."""
    source: dict[str, str] = {}
    unexpected: list[str] = []
    for ckpt_name in reader.keys():
        name = rename(ckpt_name) if rename else ckpt_name
        if name is None:
            continue
        if name not in targets:
            if not (ignore and ignore(ckpt_name)):
                unexpected.append(f"'{ckpt_name}' (in {reader.file_of(ckpt_name)})")
        elif name in source:
            raise CheckpointError(f"{reader.file_of(ckpt_name)}: tensors '{source[name]}' and "
                                  f"'{ckpt_name}' both map to '{name}'; expected one")
        else:
            source[name] = ckpt_name
    if unexpected:
        raise CheckpointError(f"{reader._describe()}: unexpected tensor(s) "
                              f"{_listed(unexpected)}; {owner} has no such names")
    return source


def _check_shapes(reader: SafetensorsReader, targets: dict[str, torch.Tensor],
                  source: dict[str, str]) -> None:
    """Shapes equal, and float stays float / integer stays integer (a cast would hide a bug)."""
    bad = []
    for name, ckpt_name in source.items():
        want, got = tuple(targets[name].shape), reader.shape(ckpt_name)
        stored = reader.dtype(ckpt_name)
        if got != want:
            bad.append(f"{reader.file_of(ckpt_name)}: tensor '{ckpt_name}' has shape {got}; "
                       f"expected {want} for '{name}'")
        elif stored.is_floating_point != targets[name].is_floating_point():
            bad.append(f"{reader.file_of(ckpt_name)}: tensor '{ckpt_name}' is {stored}; "
                       f"expected {targets[name].dtype} for '{name}'")
    if bad:
        raise CheckpointError("; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))


def load_state(module: torch.nn.Module, reader: SafetensorsReader, *,
               rename: Callable[[str], str | None] | None = None,
               dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               optional: Iterable[str] = (),
               ignore: Callable[[str], bool] | None = None) -> set[str]:
    """Fill every parameter and persistent buffer of `module` from the checkpoint.

    `rename` maps a checkpoint name to the module's name (None drops it). Names, shapes and
    float-vs-integer kind are all checked before anything is assigned, so a bad checkpoint
    leaves the module untouched: every module tensor present (except names in `optional`, left
    as they are), shapes equal, no unexpected checkpoint tensors (unless
    `ignore(checkpoint_name)`), no two checkpoint names landing on one module name. Integer
    buffers (`d2t`) keep the module's integer dtype; floating tensors become `dtype` (default:
    the module tensor's current dtype). Tensors are replaced, not copied into, so a meta-built
    module works and a large checkpoint is not held twice; tied tensors stay tied (and must
    hold equal values if the checkpoint stores both names). Returns the module names loaded.
    """
    owner = type(module).__name__
    targets = _module_tensors(module)
    optional = set(optional)
    if optional - targets.keys():
        raise ValueError(f"optional names {sorted(optional - targets.keys())} are not tensors of {owner}")
    source = _match_names(reader, targets, rename, ignore, owner)
    groups: dict[int, list[str]] = {}  # tied aliases share one tensor object
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    missing = []
    for names in groups.values():
        if not any(n in source for n in names):
            missing += [f"'{n}' {tuple(targets[n].shape)}" for n in names if n not in optional]
    if missing:
        raise CheckpointError(f"{reader._describe()}: missing tensor(s) {_listed(missing)} "
                              f"(expected shapes shown) for {owner}")
    _check_shapes(reader, targets, source)

    loaded: set[str] = set()
    for names in groups.values():
        present = [n for n in names if n in source]
        if not present:
            continue
        old = targets[names[0]]
        want_dtype = (dtype or old.dtype) if old.is_floating_point() else old.dtype
        value = reader.get(source[present[0]], dtype=want_dtype, device=device)
        for other in present[1:]:
            if not torch.equal(reader.get(source[other], dtype=want_dtype, device=device), value):
                raise CheckpointError(f"{reader.file_of(source[other])}: tensors "
                                      f"'{source[present[0]]}' and '{source[other]}' differ; "
                                      f"expected equal values, '{present[0]}' and '{other}' "
                                      f"are tied in {owner}")
        if isinstance(old, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        for n in names:  # one object for every alias keeps ties
            parent, _, leaf = n.rpartition(".")
            setattr(module.get_submodule(parent), leaf, value)
            loaded.add(n)
    return loaded


def save_state(tensors: dict[str, torch.Tensor], directory: str | Path, *,
               max_shard_bytes: int | None = None,
               metadata: dict[str, str] | None = None) -> list[Path]:
    """Write `model.safetensors`, or shards `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) when the total
    exceeds `max_shard_bytes`. Returns the files written (shards first, index last).

    Tensors are moved to CPU and made contiguous; tensors sharing storage (tied weights,
    views of one buffer) are cloned, because safetensors refuses aliases. Metadata always
    carries {"format": "pt"} (transformers requires it). Each file is written under a temporary
    name and renamed, and model*.safetensors files of an earlier save that this one does not
    rewrite are removed, so the directory never mixes two saves.
    """
    # long: the sharding, the tied-weight dedup and the index file are one format, written in one pass
    directory = Path(directory)
    if not tensors:
        raise ValueError(f"{directory}: nothing to save; expected at least one tensor")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes = {max_shard_bytes}; expected a positive byte count")
    meta = {"format": "pt", **(metadata or {})}
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"metadata[{k!r}] = {v!r}; expected str keys and values")
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if t.is_meta:
            raise ValueError(f"tensor '{name}' is on the meta device; expected real data to save")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        plain[name] = t

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in plain.items():
        n = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
        total += n
    directory.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    written = []
    for fname, shard in zip(names, shards):
        tmp = directory / (fname + ".tmp")
        save_file(shard, str(tmp), metadata=meta)
        os.replace(tmp, directory / fname)
        written.append(directory / fname)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
        tmp = directory / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / INDEX_FILE)
        written.append(directory / INDEX_FILE)
    for stale in directory.iterdir():
        ours = stale.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(stale.name)
        if ours and stale not in written:
            stale.unlink()
    return written


def draft_name(name: str) -> str | None:
    """Map an EAGLE-3 draft checkpoint name to our draft module's name.

    SpecForge saves `midlayer.*`, TorchSpec/lightseek exports `layers.0.*`, and some exports
    add a `model.` prefix; all become `layers.0.*` with no prefix (vLLM's names). `t2d` is
    unused by every server and `rotary_emb.inv_freq` is recomputed, so both are dropped.
    Other names pass through unchanged, so `load_state` reports them as unexpected.
    """
    name = name.removeprefix("model.")
    if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
TEXT_PREFIX = "language_model."  # Kimi-K2.5/K2.6: the text model's tensors, beside the vision tower's
MULTIMODAL_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")  # skipped: no text model part


def text_prefix(names: Iterable[str]) -> str:
    """`TEXT_PREFIX` when a multimodal wrapper's checkpoint stores the language model under it, else ""."""
    return TEXT_PREFIX if any(n.startswith(TEXT_PREFIX) for n in names) else ""


def skipped_multimodal(names: Iterable[str]) -> dict[str, int]:
    """How many tensors `verifier_name` skips under each multimodal prefix (vision tower, projector)."""
    counts = Counter(p for n in names for p in MULTIMODAL_PREFIXES if n.startswith(p))
    return {p: counts[p] for p in MULTIMODAL_PREFIXES if counts[p]}


def verifier_name(num_layers: int, prefix: str = "") -> Callable[[str], str | None]:
    """The verifier's rename: HF DeepseekV3ForCausalLM names are ours, so identity, except that
    `prefix` (a multimodal wrapper's `language_model.`) is stripped, the wrapper's vision tower and
    projector (`MULTIMODAL_PREFIXES`) are skipped, and `rotary_emb.inv_freq` (recomputed) and
    layers >= `num_layers` (DeepSeek-V3's MTP layer 61, which the verifier does not run) are dropped."""
    def rename(name: str) -> str | None:
        if name.startswith(MULTIMODAL_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
            return None
        name = name.removeprefix(prefix) if prefix else name
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= num_layers:
            return None
        return name
    return rename
