"""Export an RL checkpoint for serving: a Hugging Face `kimi_linear` model directory.

`export_checkpoint(checkpoint, out)` turns one published checkpoint (`run_dir/checkpoints/iter_N`)
into a directory that `transformers.KimiLinearForCausalLM.from_pretrained` (and servers that read
the same layout) load:

    config.json                        kimi_linear config: model_type, architectures, every ModelConfig
                                       field in Moonshot's keys, dtype (and torch_dtype, older readers)
    model.safetensors                  the weights in Moonshot's on-disk layout (models/checkpoint.py),
      or model-0000i-of-0000n.safetensors + model.safetensors.index.json when they exceed one shard
                                       (the index: {"metadata": {"total_size"}, "weight_map"})
    generation_config.json             the run tokenizer's bos/pad ids, its eos and end-of-turn ids (config.json
                                       carries the same bos/eos/pad), and the run's sampling (temperature, top_p, top_k)
    tokenizer files                    a Hugging Face tokenizer directory's files, copied; the byte tokenizer
                                       written as a byte-level tokenizer.json (rl/export/tokenizer.py): either
                                       loads with transformers' AutoTokenizer, chat template included
    README.txt                         where it came from, and the tokenizer

The checkpoint's weights are already in the on-disk layout, so tensors are streamed from its
safetensors into the shards one at a time (host memory: one shard), cast to `dtype` except the
precision-sensitive ones models/precision.py keeps in float32 (KDA's A_log and dt_bias, the
routers' weight and correction bias), as Kimi Linear's own checkpoints ship them. Shards follow
layer order and hold at most `max_shard_bytes` each (a single larger tensor gets a shard of its
own), as transformers' `save_pretrained` does.

Atomic: everything is written into `.tmp_export_<name>` beside `out`, fsynced, then renamed to `out`;
a failure removes the temporary directory, so `out` is either absent or complete. `out` must not
exist, or be an empty directory (`overwrite=True`, the loop's `checkpoint.export_every` hook,
replaces an older export of the same iteration instead).

Refused (ExportError naming the field): models transformers' kimi_linear would load but compute
differently: gated MLA (`mla_output_gate`) and rotary MLA (`mla_use_nope=False`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from memory.durable import fsync_dir, fsync_tree, temp_path
from models.checkpoint import INDEX_FILE, SINGLE_FILE, to_disk_name
from models.config import ModelConfig
from models.precision import KEEP_FP32, parse_dtype
from models.tokenizer import ByteTokenizer
from rl.export.tokenizer import special_ids, write_byte_tokenizer

RUN_CONFIG = "run_config.json"
"""The run's resolved config, stored in every checkpoint (rl/run/checkpoint.py writes it)."""
HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_SAFETENSORS_DTYPE = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
# The float32-kept tensors by their on-disk suffix (our `mlp.` is the disk's `block_sparse_moe.`).
KEEP_FP32_ON_DISK = tuple(to_disk_name(f"model.layers.0.{s}").removeprefix("model.layers.0.") for s in KEEP_FP32) + (
    "e_score_correction_bias",)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Files of a tokenizer directory that are not the tokenizer (a model directory often holds both).
_NOT_TOKENIZER = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.gguf|\.index\.json|^config\.json|"
                            r"^generation_config\.json|^README\.txt)$")
WRITTEN = ("config.json", "generation_config.json", "README.txt")


class ExportError(ValueError):
    """An export was asked for something it cannot write; the message names the bad value."""


def parse_size(text: str | int) -> int:
    """"5GB" -> 5_000_000_000 (KB/MB/GB/TB: powers of 1000, KiB/MiB/GiB/TiB: of 1024, as transformers'
    max_shard_size), a bare number = bytes. ExportError naming the value otherwise."""
    m = _SIZE.match(str(text))
    size = int(float(m[1]) * _UNITS[(m[2] or "b").lower()]) if m else 0
    if size < 1:
        raise ExportError(f"max_shard_size={text!r}, expected a positive size such as 5GB, 500MB, 2GiB or a "
                          f"byte count")
    return size


def check_servable(config: ModelConfig) -> None:
    """ExportError when transformers' kimi_linear cannot compute this model (it would load and differ)."""
    if config.mla_output_gate:
        raise ExportError("model.mla_output_gate=True (gated MLA, our extension): transformers' kimi_linear has no "
                          "o_gate_proj and would drop it; only mla_output_gate=False models export")
    if not config.mla_use_nope:
        raise ExportError("model.mla_use_nope=False (rotary MLA): transformers' kimi_linear runs MLA without "
                          "rotary embeddings (NoPE); only mla_use_nope=True models export")


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of the export: Moonshot's keys (ModelConfig.to_hf_dict) plus the weights' dtype."""
    out = config.to_hf_dict()
    out.pop("mla_output_gate", None)
    out["dtype"] = out["torch_dtype"] = HF_DTYPE[dtype]
    dense = config.mlp_layer_types.index("moe") if "moe" in config.mlp_layer_types else config.num_hidden_layers
    if all(t == "moe" for t in config.mlp_layer_types[dense:]):  # Moonshot's own spelling of the MLP pattern
        out["first_k_dense_replace"], out["moe_layer_freq"] = dense, 1
    return out


def generation_config(config: ModelConfig, run_config: dict) -> dict:
    """generation_config.json: the special ids, and the rollout's sampling (temperature/top_p/top_k;
    top_k=0 is off in both). The rollout's max_new_tokens is a training budget, not a serving default:
    left out."""
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.pad_token_id}
    rollout = run_config.get("rollout") or {}
    sampling = {k: rollout[k] for k in ("temperature", "top_p", "top_k") if k in rollout}
    if sampling:
        out.update(do_sample=True, **sampling)
    return out


def _natural(name: str) -> list:
    """Sort key: model.layers.2 before model.layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _source_files(checkpoint: Path) -> dict[str, str]:
    """Tensor name -> file of the checkpoint's weights (single file or sharded)."""
    if (checkpoint / INDEX_FILE).exists():
        return json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"]
    if not (checkpoint / SINGLE_FILE).exists():
        raise ExportError(f"checkpoint {checkpoint} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(checkpoint / SINGLE_FILE, framework="pt") as f:
        return {name: SINGLE_FILE for name in f.keys()}


def _plan_shards(checkpoint: Path, dtype: torch.dtype, max_shard_bytes: int) -> list[list[tuple[str, str, torch.dtype]]]:
    """Shards as lists of (name, source file, target dtype), from the tensors' headers (nothing loaded).
    Floating tensors become `dtype` (float32 for KEEP_FP32_ON_DISK), others keep theirs."""
    weight_map = _source_files(checkpoint)
    shards: list[list[tuple[str, str, torch.dtype]]] = [[]]
    shard_bytes = 0
    for name in sorted(weight_map, key=_natural):
        with safe_open(checkpoint / weight_map[name], framework="pt") as f:
            piece = f.get_slice(name)
            shape, stored = piece.get_shape(), _SAFETENSORS_DTYPE[piece.get_dtype()]
        target = (torch.float32 if name.endswith(KEEP_FP32_ON_DISK) else dtype) if stored.is_floating_point else stored
        size = torch.Size(shape).numel() * target.itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, weight_map[name], target))
        shard_bytes += size
    return shards


def _write_weights(checkpoint: Path, tmp: Path, dtype: torch.dtype, max_shard_bytes: int) -> tuple[list[str], int]:
    """Write the shards (and the index when more than one) into `tmp`; returns (files, total bytes)."""
    shards = _plan_shards(checkpoint, dtype, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total, weight_map = 0, {}
    for file, shard in zip(names, shards):
        tensors = {}
        for name, source, target in shard:
            with safe_open(checkpoint / source, framework="pt") as f:
                tensor = f.get_tensor(name)
            tensors[name] = tensor.to(target).contiguous()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names, total


def _copy_tokenizer(tokenizer: str | None, tmp: Path) -> tuple[list[str], str]:
    """Copy a Hugging Face tokenizer directory's files into `tmp` (not its weights or config.json);
    returns (copied names, README paragraph)."""
    if tokenizer in (None, "byte"):
        byte = ByteTokenizer()
        what = "the run's tokenizer was not recorded" if tokenizer is None else "the run used the byte tokenizer"
        written = write_byte_tokenizer(tmp)
        return written, (f"Tokenizer: the byte tokenizer ({what}) as a byte-level tokenizer.json ({', '.join(written)}): "
                         f"ids 0..255 are the UTF-8 bytes of the text, {byte.bos_token_id} is bos (prepended to a "
                         f"prompt), {byte.eos_token_id} eos, {byte.pad_token_id} pad; its chat template renders a "
                         f"conversation as the run did (bos, then the contents).")
    source = Path(tokenizer)
    if not source.is_dir():
        raise ExportError(f"tokenizer={tokenizer!r} (the run's tokenizer.path) is not a directory here; pass "
                          f"tokenizer=<directory> to copy it from where it is now, or tokenizer=byte")
    copied = sorted(p.name for p in source.iterdir() if p.is_file() and not _NOT_TOKENIZER.search(p.name))
    if not copied:
        raise ExportError(f"tokenizer={tokenizer!r} holds no tokenizer files")
    for name in copied:
        shutil.copy2(source / name, tmp / name)
    return copied, f"Tokenizer: the files of {source.resolve()} ({', '.join(copied)})."


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "bf16",
                      max_shard_bytes: int = 5 * 10**9, tokenizer: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write checkpoint directory `checkpoint` (config.json + safetensors; its run_config.json gives
    the tokenizer and the sampling) as a servable directory `out` (module docstring: the files,
    atomicity). `dtype`: "fp32" | "bf16"; `tokenizer`: "byte" or a Hugging Face tokenizer directory,
    None = the run's `tokenizer.path`. Returns `out`; on return every file is durable."""
    checkpoint, out = Path(checkpoint), Path(out)
    try:
        torch_dtype = parse_dtype(dtype)
    except ValueError as err:
        raise ExportError(str(err)) from None
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out={str(out)!r} exists and is not an empty directory; choose another out or remove it")
    config = ModelConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    check_servable(config)
    run_config = json.loads((checkpoint / RUN_CONFIG).read_text()) if (checkpoint / RUN_CONFIG).exists() else {}
    if tokenizer is None:
        tokenizer = ((run_config.get("tokenizer") or {}).get("path")  # older runs: task.tokenizer
                     or (run_config.get("task") or {}).get("tokenizer"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out.parent / f".tmp_export_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a failed export
    tmp.mkdir()
    try:
        copied, tokenizer_note = _copy_tokenizer(tokenizer, tmp)
        files, total = _write_weights(checkpoint, tmp, torch_dtype, max_shard_bytes)
        ids = special_ids(tokenizer)  # the run tokenizer's, which the model was trained with
        hf = hf_config(config, torch_dtype) | {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        gen = generation_config(config, run_config) | {
            "bos_token_id": ids["bos_token_id"], "pad_token_id": ids["pad_token_id"],
            "eos_token_id": ids["stop_token_ids"] if len(ids["stop_token_ids"]) > 1 else ids["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "README.txt").write_text(
            f"Exported from {checkpoint.resolve()} by `python -m rl.export`: a kimi_linear model for "
            f"transformers' KimiLinearForCausalLM.from_pretrained.\nWeights: {dtype} ({HF_DTYPE[torch_dtype]}; "
            f"A_log, dt_bias and the routers stay float32), {len(files)} file(s), {total:,} bytes.\n"
            f"{tokenizer_note}\n")
        fsync_tree(tmp)
        if overwrite and out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
