"""Safetensors checkpoints in and out: read (single, sharded, or loose files), load into a
module by name, save (optionally sharded), and the name maps for our two models.

Weights are safetensors only: a pickle (`.bin`, `.pt`) can run code when opened, so it is
refused, never opened. Loading checks everything nanoGPT's `from_pretrained` checks (key
sets, shapes) before any tensor is assigned, so a bad checkpoint fails whole, not halfway,
and every error names the file, the tensor and what was expected.

FP8 checkpoints (DeepSeek-V3, Kimi-K2) store `X.weight` as float8_e4m3fn plus
`X.weight_scale_inv`, one fp32 scale per 128x128 block; the reader dequantises on `get`.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import struct
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


class SafetensorsReader:
    """A checkpoint directory's tensors, memory-mapped: single `model.safetensors`, sharded via
    `model.safetensors.index.json` (weight_map), or (fallback) every `*.safetensors` in the dir.

    Files are opened once, up front, so a corrupt or missing file fails at construction rather
    than in the middle of a load. `*_scale_inv` tensors are hidden from `keys()` because they
    are folded into their fp8 weight by `get`; `get` still returns them by exact name.
    """

    def __init__(self, directory: str | Path):
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
        return [n for n in self._where if not n.endswith(SCALE_SUFFIX)]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        if name not in self._where:
            near = difflib.get_close_matches(name, self._where, n=3)
            raise CheckpointError(f"{self._describe()}: no tensor '{name}'"
                                  + (f"; did you mean {near}?" if near else ""))
        return str(self._where[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(Path(self.file_of(name))).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype (fp8 weights report fp8 even though `get` dequantises them)."""
        path = self.file_of(name)
        code = self._open(Path(path)).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {code}; "
                                  f"expected one of {sorted(_DTYPES)}")
        return _DTYPES[code]

    def get(self, name: str, dtype: torch.dtype | None = None,
            device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor, on `device`, cast to `dtype` (default: as stored; float32 for fp8 with
        block scales, which are applied first so no precision is lost before the cast)."""
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
        want = tuple(math.ceil(d / b) for d, b in zip(t.shape, FP8_BLOCK))
        if t.dim() != 2 or tuple(s.shape) != want:
            raise CheckpointError(f"{self.file_of(scale)}: tensor '{scale}' has shape "
                                  f"{tuple(s.shape)}; expected {want} for weight '{name}' "
                                  f"of shape {tuple(t.shape)} in {FP8_BLOCK} blocks")
        return dequantize_fp8_blocks(t.to(device), s.to(device), FP8_BLOCK, dtype or torch.float32)


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


def verifier_name(num_layers: int) -> Callable[[str], str | None]:
    """The verifier's rename: HF DeepseekV3ForCausalLM names are ours, so identity, except that
    `rotary_emb.inv_freq` (recomputed) and layers >= `num_layers` (DeepSeek-V3's MTP layer 61,
    which the verifier does not run) are dropped."""
    def rename(name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= num_layers:
            return None
        return name
    return rename
