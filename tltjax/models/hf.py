"""Hugging Face checkpoints: read and write ``safetensors`` lazily, tensor by tensor.

Loading never materialises the whole model on the host: each tensor is
memory-mapped from its file and each device reads only the slice its shard
needs (`jax.make_array_from_callback`), so a sharded model loads with host RAM
of about one shard. Sharded checkpoints (``model.safetensors.index.json``) are
read through their weight map. Names and ``[out, in]`` layouts are Hugging
Face's own, so no renaming or transposition is needed.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tltjax import sharding as shd
from tltjax.models.config import ModelConfig
from tltjax.models.transformer import CausalLM

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into."""


# ----------------------------------------------------------------------------- safetensors
class SafetensorsFile:
    """A lazily read ``.safetensors`` file: header parsed once, tensors memory-mapped on demand."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{self.path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = self.path.stat().st_size
            if n > size - 8:  # checked before reading: a corrupt length must not allocate n bytes
                raise CheckpointError(
                    f"{self.path}: corrupt safetensors header (declares {n} header bytes, file has {size})"
                )
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self.data_start = 8 + n

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory map (no copy until sliced and used)."""
        e = self.entries[name]
        dt = _ST_DTYPES.get(e["dtype"])
        if dt is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
        start, end = e["data_offsets"]
        shape = tuple(e["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dt.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name} byte range does not match its shape {shape}")
        if count == 0:
            return np.zeros(shape, dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + start, shape=shape)


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | pathlib.Path, metadata=None) -> None:
    """Writes ``tensors`` (sorted by name) in the safetensors format, atomically."""
    path = pathlib.Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    names = sorted(tensors)
    arrays = []
    for name in names:
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_NAMES:
            raise CheckpointError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    tmp.replace(path)


class Checkpoint:
    """All tensors of a (possibly sharded) Hugging Face model directory, read lazily."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        self._files: dict[str, SafetensorsFile] = {}
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: self.path / fname for name, fname in weight_map.items()}
        elif single.exists():
            f = self._file(single)
            self.where = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.path}; "
                "pass a Hugging Face model directory"
            )

    def _file(self, p: pathlib.Path) -> SafetensorsFile:
        if p not in self._files:
            if not p.exists():
                raise CheckpointError(f"{p} is listed in the index but missing")
            self._files[p] = SafetensorsFile(p)
        return self._files[p]

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.where[name]).shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(self.where[name]).get(name)


# ----------------------------------------------------------------------------- model I/O
def param_paths(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Hugging Face tensor name → the model's parameter variable."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[".".join(str(p) for p in path)] = var
    return out


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model with shape-only parameters (nothing allocated)."""
    return nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))


def _read_into(ckpt: Checkpoint, name: str, var, mesh: Mesh | None, dtype) -> jax.Array:
    src = ckpt.get(name)
    if mesh is None:
        return jax.device_put(np.asarray(src).astype(dtype))
    axes = var.get_metadata().get("axes")
    sh = shd.named_sharding(src.shape, axes, mesh) if axes else NamedSharding(mesh, P())
    return jax.make_array_from_callback(src.shape, sh, lambda idx: np.asarray(src[idx]).astype(dtype))


def load_params(model: nnx.Module, path: str | pathlib.Path, mesh: Mesh | None = None) -> nnx.Module:
    """Fills ``model``'s parameters from the checkpoint at ``path`` (in place), one tensor at a time.

    Every checkpoint tensor must match a parameter by name and shape and every
    parameter must be present; otherwise `CheckpointError` names the tensor.
    ``lm_head.weight`` in a checkpoint of a tied-embedding model is ignored.
    """
    ckpt = Checkpoint(path)
    params = param_paths(model)
    names = set(ckpt.keys())
    cfg: ModelConfig = model.config
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")
    unexpected = sorted(n for n in names if n not in params and not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(n for n in params if n not in names)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) the {cfg.model_type} config needs, "
            f"first: {missing[:5]}"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {len(unexpected)} tensor(s) the {cfg.model_type} config does not use, "
            f"first: {unexpected[:5]} (does config.json match the weights?)"
        )
    for name, var in params.items():
        want = tuple(var.shape)
        got = ckpt.shape(name)
        if got != want:
            raise CheckpointError(f"checkpoint tensor {name} has shape {got}, config expects {want}")
        var.set_value(_read_into(ckpt, name, var, mesh, var.dtype))
    return model


def from_pretrained(
    path: str | pathlib.Path,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    mesh: Mesh | None = None,
    remat: bool = False,
) -> CausalLM:
    """Builds the model described by ``path/config.json`` and loads its weights.

    ``dtype`` is the compute dtype and, unless ``param_dtype`` is given, also
    the parameter dtype (``"float32"`` or ``"bfloat16"``); by default the
    checkpoint's ``torch_dtype``. With ``mesh``, each tensor goes straight to
    its shard.
    """
    raw = json.loads((pathlib.Path(path) / "config.json").read_text()) if (pathlib.Path(path) / "config.json").exists() else None
    if raw is None:
        raise FileNotFoundError(f"no config.json in {path}; pass a Hugging Face model directory")
    ckpt_dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if ckpt_dtype not in ("float32", "bfloat16", "float16"):
        ckpt_dtype = "float32"
    dtype = dtype or ckpt_dtype
    config = ModelConfig.from_hf_dict(raw, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat)
    model = abstract_model(config)
    return load_params(model, path, mesh)


def state_dict(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, host array) per parameter, one at a time."""
    for name, var in param_paths(model).items():
        yield name, np.asarray(jax.device_get(var[...]))


def save_pretrained(model: CausalLM, path: str | pathlib.Path, *, max_shard_bytes: int = 4 << 30) -> None:
    """Writes ``config.json`` and safetensors weights that ``transformers`` loads.

    Above ``max_shard_bytes`` the weights are split into shards with an index
    file, as Hugging Face does. Files are written atomically.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json(path / "config.json")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in sorted(state_dict(model)):
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors(shards[0], path / "model.safetensors", meta)
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path / fname, meta)
        for name, a in shard.items():
            weight_map[name] = fname
            total += a.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "model.safetensors").unlink(missing_ok=True)
