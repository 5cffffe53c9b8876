"""Load and save Hugging Face-format checkpoint directories of Kimi Linear models.

A directory holds `config.json` plus either `model.safetensors` or shards listed by
`model.safetensors.index.json` ({"metadata": {"total_size": ...}, "weight_map": {name: file}}).
The on-disk tensor layout is Moonshot's original one, which real Kimi-Linear checkpoints and
transformers' `save_pretrained` of `kimi_linear` both use. Our module names equal it except for
three rules (the whole name map):

    ours                                         on disk
    model.layers.N.mlp.<rest>                <-> model.layers.N.block_sparse_moe.<rest>   (dense MLPs too)
    model.layers.N.self_attn.A_log [H]       <-> model.layers.N.self_attn.A_log [1, 1, H, 1]
    ...mlp.experts.w{1,2,3} [E, out, in]     <-> ...block_sparse_moe.experts.{e}.w{1,2,3}.weight [out, in]

(experts are stacked in memory so they run as batched matmuls). The short convs stay split
(`q_conv1d/k_conv1d/v_conv1d.weight`, [channels, 1, kernel]), `A_log`/`dt_bias`/`f_a_proj`/`f_b_proj`
sit directly under `self_attn`. Gated MLA's `o_gate_proj` is our extension (absent in Kimi Linear).
Tensors keep their on-disk dtype unless a dtype is asked for.
"""
from __future__ import annotations

import json
import os
import secrets
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.mlp import Experts
from models.model import HybridLM
from models.precision import KEEP_FP32

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MLP = re.compile(r"^(model\.layers\.\d+\.)mlp\.")
# Kept in float32 whatever the model dtype, as in the reference (routing and decay are precision-sensitive):
# the parameters models/precision.py keeps in float32, and the routers' correction bias (a buffer).
_FP32_SUFFIXES = ("e_score_correction_bias", *KEEP_FP32)


class CheckpointError(ValueError):
    """A checkpoint directory does not match the model its config describes."""


_STACKED_EXPERTS = re.compile(r"^(.*)\.experts\.(w[123])$")


def to_disk_name(name: str) -> str:
    return _MLP.sub(r"\1block_sparse_moe.", name)


def _to_disk(name: str, tensor: torch.Tensor, first: int = 0) -> list[tuple[str, torch.Tensor]]:
    """One of our tensors -> its on-disk (name, tensor) pieces (views, no copies). A stacked expert
    tensor holding global experts `first` .. (expert parallelism: this rank's share) names each
    piece by its global index."""
    disk = to_disk_name(name)
    if name.endswith("self_attn.A_log"):
        return [(disk, tensor.reshape(1, 1, -1, 1))]
    stacked = _STACKED_EXPERTS.match(disk)
    if stacked:
        prefix, w = stacked.groups()
        return [(f"{prefix}.experts.{first + e}.{w}.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(disk, tensor)]


def _expert_layout(model: HybridLM) -> dict[str, tuple[int, int]]:
    """(first global expert, global expert count) of every stacked expert tensor, by our name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for w in ("w1", "w2", "w3"):
                out[f"{name}.{w}"] = (module.first, module.num_global)
    return out


def disk_pieces(model: HybridLM, state: dict[str, torch.Tensor] | None = None
                ) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Our name -> the on-disk (name, tensor) pieces of the tensor `model` holds (this rank's experts)."""
    layout = _expert_layout(model)
    state = model.state_dict(keep_vars=True) if state is None else state
    return {n: _to_disk(n, t, layout.get(n, (0, 0))[0]) for n, t in state.items()}


def disk_shapes(model: HybridLM) -> dict[str, tuple[int, ...]]:
    """Every on-disk tensor name of the whole model (all experts, whatever this rank holds) -> shape."""
    layout = _expert_layout(model)
    shapes = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name in layout:
            prefix, w = _STACKED_EXPERTS.match(to_disk_name(name)).groups()
            for e in range(layout[name][1]):
                shapes[f"{prefix}.experts.{e}.{w}.weight"] = tuple(t.shape[1:])
        else:
            shapes.update((d, tuple(piece.shape)) for d, piece in _to_disk(name, t))
    return shapes


def _disk_files(path: Path) -> tuple[dict[str, str] | None, list[str]]:
    """(weight map or None for a single file, the files to read) of a checkpoint directory."""
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return weight_map, sorted(set(weight_map.values()))
    if (path / SINGLE_FILE).exists():
        return None, [SINGLE_FILE]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _index_tensors(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(shape, file) of every tensor of a checkpoint directory, single file or sharded, read from
    the files' headers (no tensor data)."""
    weight_map, files = _disk_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    file_of: dict[str, str] = {}
    for file in files:
        if not (path / file).exists():
            raise CheckpointError(f"{path}: shard {file} listed in {INDEX_FILE} is missing")
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    raise CheckpointError(f"{path}: tensor {name} found in {file} but the index maps it to "
                                          f"{weight_map.get(name)!r}")
                shapes[name], file_of[name] = tuple(f.get_slice(name).get_shape()), file
    if weight_map is not None and set(weight_map) - set(shapes):
        raise CheckpointError(f"{path}: tensors listed in {INDEX_FILE} are absent from their shards: "
                              f"{sorted(set(weight_map) - set(shapes))[:10]}")
    return shapes, file_of


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class _Reader:
    """Reads a safetensors file's tensors with plain reads (no memory map, so no page of the file is
    mapped into the process): `read_into` fills a CPU tensor of the stored dtype and size in place,
    with no temporary; `get` returns a new tensor."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(size))
        self.base = 8 + size

    def _entry(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        return _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], self.base + begin, end - begin

    def fits(self, name: str, dest: torch.Tensor) -> bool:
        dtype, shape, _, _ = self._entry(name)
        return (dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
                and dest.numel() == torch.Size(shape).numel())

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        _, _, offset, nbytes = self._entry(name)
        view = dest.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes
        if view.nbytes != nbytes:
            raise CheckpointError(f"{self.file.name}: {name} holds {nbytes} B, the destination {view.nbytes} B")
        self.file.seek(offset)
        if self.file.readinto(view) != nbytes:
            raise CheckpointError(f"{self.file.name}: {name} is truncated")

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, _, _ = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out

    def close(self) -> None:
        self.file.close()


def load_weights(model: HybridLM, path: str | Path, dtype: torch.dtype | None = None, assign: bool = True) -> HybridLM:
    """Fill `model` (possibly on the meta device) with the tensors of checkpoint directory `path`.

    assign=True replaces the parameter tensors (needed for a meta-device model); assign=False
    copies into the existing ones, so references held elsewhere (optimizers) stay valid.

    Strict: every missing, unexpected or mis-shaped tensor is reported by its on-disk name with
    the expected and actual shapes, and nothing is loaded unless all match. Returns the model.
    An expert-parallel model (models/expert_parallel.py) reads only its own experts' tensors; the
    check covers the whole model's. Streamed, with plain reads (no memory map): with assign=False
    each tensor is read straight into its parameter (a temporary only where the dtype or device
    differs), with assign=True it becomes the parameter; so loading holds the model plus at most one
    on-disk tensor.
    """
    path = Path(path)
    ours = model.state_dict(keep_vars=True)
    pieces_of = disk_pieces(model, ours)
    expected = disk_shapes(model)
    shapes, file_of = _index_tensors(path)
    missing = [f"{d} (expected shape {list(s)})" for d, s in expected.items() if d not in shapes]
    extra = [f"{d} (shape {list(s)})" for d, s in shapes.items() if d not in expected]
    bad_shape = [f"{d}: expected shape {list(expected[d])}, found {list(s)}"
                 for d, s in shapes.items() if d in expected and s != expected[d]]
    if missing or extra or bad_shape:
        lines = [f"checkpoint {path} does not match the model described by its config:"]
        for title, items in (("missing tensors", missing), ("unexpected tensors", extra), ("wrong shapes", bad_shape)):
            if items:
                lines.append(f"  {title} ({len(items)}): " + "; ".join(items[:20]) + (" ..." if len(items) > 20 else ""))
        raise CheckpointError("\n".join(lines))
    state = {}
    with ExitStack() as files:
        handles = {}
        for f in sorted(set(file_of.values())):
            handles[f] = _Reader(path / f)
            files.callback(handles[f].close)
        for name, param in ours.items():
            stacked = _STACKED_EXPERTS.match(to_disk_name(name)) is not None
            cast = dtype if dtype is not None and param.is_floating_point() and not name.endswith(_FP32_SUFFIXES) else None
            if not assign:  # in place, piece by piece: read straight into the tensor where it can
                with torch.no_grad():
                    for e, (d, _) in enumerate(pieces_of[name]):
                        dest = param.detach()[e] if stacked else param.detach()
                        reader = handles[file_of[d]]
                        if reader.fits(d, dest):
                            reader.read_into(d, dest)
                        else:
                            dest.copy_(reader.get(d).reshape(dest.shape))
                continue
            pieces = [handles[file_of[d]].get(d) for d, _ in pieces_of[name]]
            tensor = torch.stack(pieces) if stacked else pieces[0].reshape(param.shape)
            del pieces
            state[name] = tensor.to(cast) if cast is not None else tensor
    if assign:
        model.load_state_dict(state, strict=True, assign=True)
    return model


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> HybridLM:
    """Build a HybridLM from a checkpoint directory (config.json + safetensors), on CPU."""
    path = Path(path)
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):  # no random init: every tensor comes from disk
        model = HybridLM(config)
    return load_weights(model, path, dtype).eval()


def checkpoint_dtype(path: str | Path) -> torch.dtype | None:
    """The weights' dtype a checkpoint directory declares in config.json ("dtype", or transformers'
    older "torch_dtype"), None when it declares none."""
    hf = json.loads((Path(path) / "config.json").read_text())
    name = hf.get("dtype") or hf.get("torch_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}/config.json declares dtype {name!r}, which is not a torch dtype")
    return dtype


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_mode() -> int:
    """0o666 less this process's umask (read from /proc, since os.umask can only be read by setting it,
    which races with other threads creating files), as `open` would create a file."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = 0o022
    return 0o666 & ~mask


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` to a temporary name, fsync it, rename it over `path` (its directory is fsynced
    once by the caller, after all renames). The file gets the mode `open` would give it (safetensors
    creates its files 0600): others may read an export, as the umask says."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # no two writers share it
    write(tmp)
    os.chmod(tmp, _file_mode())
    _fsync(tmp)
    os.replace(tmp, path)


def save_checkpoint(model: HybridLM, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write `model` as a checkpoint directory loadable by `load_checkpoint` and by transformers.

    With `max_shard_bytes`, tensors are split across `model-0000i-of-0000n.safetensors` shards (in
    state-dict order) plus `model.safetensors.index.json`. Each file is written under a temporary
    name, fsynced and renamed, and files of an older save that the new one does not use are removed
    last; the directory is fsynced before returning, so the files survive a power loss.
    An expert-parallel model (its experts split over ranks) is saved by `save_expert_shard` on
    every rank of its expert-parallel group instead.
    """
    if model.expert_parallel is not None:
        raise ValueError("save_checkpoint of an expert-parallel model (it holds only its share of the experts): "
                         "call save_expert_shard on every rank of its expert-parallel group")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {d: t.detach().to("cpu").contiguous() for n, p in model.state_dict().items() for d, t in _to_disk(n, p)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += size
    hf = model.config.to_hf_dict()
    hf["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    _atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(hf, indent=2) + "\n"))
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _atomic_write(path / name, lambda p, shard=shard: save_file(shard, str(p), metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        _atomic_write(path / INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
    stale = [p for p in path.glob("model*.safetensors*") if p.name not in names and p.name != INDEX_FILE]
    if len(shards) == 1:
        stale += [path / INDEX_FILE] if (path / INDEX_FILE).exists() else []
    for p in stale:
        p.unlink()
    _fsync(path, directory=True)
    return path


def save_expert_shard(model: HybridLM, path: str | Path) -> Path:
    """This rank's part of an expert-parallel model's checkpoint, in the one-rank layout (each
    expert's tensors under their own global names): file `model-0000{r+1}-of-0000{P}.safetensors`
    for expert-parallel rank r of P holds rank r's experts, and rank 0's also every other tensor;
    rank 0 writes config.json and the index (its weight map follows from the config alone). Every
    rank of the group calls it (each file atomic, the directory fsynced); the directory is
    complete once all have returned (the caller's barrier), and loads at any expert-parallel size."""
    ep = model.expert_parallel
    if ep is None:
        raise ValueError("save_expert_shard of a model without expert parallelism: use save_checkpoint")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = _expert_layout(model)
    names = [f"model-{r + 1:05d}-of-{ep.size:05d}.safetensors" for r in range(ep.size)]
    mine = {d: t.detach().to("cpu").contiguous() for n, pieces in disk_pieces(model, model.state_dict()).items()
            if n in layout or ep.rank == 0 for d, t in pieces}
    _atomic_write(path / names[ep.rank], lambda p: save_file(mine, str(p), metadata={"format": "pt"}))
    if ep.rank == 0:
        per = model.config.num_experts // ep.size
        expert = re.compile(r"\.experts\.(\d+)\.w[123]\.weight$")
        shapes = disk_shapes(model)
        dtypes = {d: t.dtype for d, t in mine.items()}
        weight_map, total = {}, 0
        for d, shape in shapes.items():
            found = expert.search(d)
            weight_map[d] = names[int(found.group(1)) // per] if found else names[0]
            dtype = dtypes.get(d) or next(t.dtype for n, t in mine.items() if expert.search(n))
            total += torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        hf = model.config.to_hf_dict()
        hf["dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        _atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(hf, indent=2) + "\n"))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_write(path / INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
        for p in path.glob("model*.safetensors"):
            if p.name not in names:
                p.unlink()
    _fsync(path, directory=True)
    return path
