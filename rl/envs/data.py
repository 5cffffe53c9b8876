"""Your own prompts: `DataConfig` (which files, which columns), `load_rows` and `RowSampler`.

A *row* is a dict {"prompt": str or [{"role", "content"}, ...], "label": ..., <extra keys>...}, built
from one record of a training file (verl / slime conventions: a prompt column, a ground-truth
column, extra columns handed to the reward function). Files are `.jsonl` (read here), `.parquet`
(pyarrow) or a Hugging Face `datasets` directory written by `save_to_disk` (the `datasets`
library); the latter two need their library installed and say so when it is not.

`RowSampler` is indexable by a global counter: `sampler[i]` is the i-th row of a deterministic
order (epoch i // n shuffled by (seed, epoch)), so every rank agrees on which group gets which row
without talking; `take()` returns the row at its position and advances it; the position
(epoch, index) is its checkpoint state.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROMPT, LABEL = "prompt", "label"
"""The keys of a row's prompt and label, whatever the columns are called in the files."""


class DataExhausted(StopIteration):
    """The sampler has handed out every row of its `epochs` epochs."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts (and labels) read from files instead of a generated task: the RL run's `data` group."""
    train_files: Any = field(default_factory=list)
    """Training rows: a list of .jsonl, .parquet or `datasets.save_to_disk` directories (one path alone is a
    one-file list); [] = the task generates prompts."""
    val_files: Any = field(default_factory=list)
    """Validation rows, same formats (loaded by `load_rows` like the training ones)."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a dotted path for a nested one): a string, or a list of chat messages
    [{"role", "content"}]."""
    label_key: str | None = "label"
    """Column holding the ground truth handed to the reward, a nested one by its dotted path; the default
    falls back to verl's reward_model.ground_truth when a file has no "label"; None = rows have no label."""
    extra_keys: list[str] = field(default_factory=list)
    """Further columns copied into each row (the reward function's `extra_info`)."""
    max_prompt_tokens: int | None = None
    """Rows whose rendered prompt is longer are dropped at load (and counted); None = keep all."""
    shuffle: bool = True
    """Shuffle each epoch (deterministically, by `seed` and the epoch)."""
    seed: int = 0
    """Seed of the epochs' shuffles."""
    epochs: int | None = None
    """Passes over the training rows; None = forever."""

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            if isinstance(getattr(self, name), str):  # `data.train_files=x.jsonl`: one file
                object.__setattr__(self, name, [getattr(self, name)])
            elif isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, list(getattr(self, name)))
        for name in ("train_files", "val_files", "extra_keys"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name}={value!r}, expected a list of non-empty strings")
        if not isinstance(self.prompt_key, str) or not self.prompt_key:
            raise ValueError(f"prompt_key={self.prompt_key!r}, expected a non-empty column name")
        if self.label_key is not None and (not isinstance(self.label_key, str) or not self.label_key):
            raise ValueError(f"label_key={self.label_key!r}, expected a non-empty column name or null (no label)")
        taken = {self.prompt_key, self.label_key, PROMPT, LABEL}
        clash = [k for k in self.extra_keys if k in taken]
        if clash or len(set(self.extra_keys)) != len(self.extra_keys):
            raise ValueError(f"extra_keys={list(self.extra_keys)!r}, expected distinct names other than the prompt "
                             f"and label keys {sorted(k for k in taken if k)}")
        for name in ("max_prompt_tokens", "epochs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}, expected an integer >= 1 or null")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}, expected an integer")

    @property
    def enabled(self) -> bool:
        """A data source is configured (else the task generates its own prompts)."""
        return bool(self.train_files)


@dataclass
class LoadedRows:
    rows: list[dict]
    num_dropped_too_long: int = 0
    """Rows dropped because their prompt had more than max_prompt_tokens tokens."""


_RECORDS: dict[tuple[str, int, int], list[tuple[str, dict]]] = {}
"""(absolute path, mtime_ns, size) -> its records: the composition's check reads each file once, the
run's build takes the same records (the last few files only)."""


def _read_records(path: str) -> list[tuple[str, dict]]:
    """[(where, record)] of one file, `where` naming the file and the line or row for errors."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _RECORDS:
        while len(_RECORDS) >= 4:
            _RECORDS.pop(next(iter(_RECORDS)))
        _RECORDS[key] = _parse_records(path)
    return _RECORDS[key]


def _parse_records(path: str) -> list[tuple[str, dict]]:
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError:
            raise ValueError(f"data file {path!r} is a directory (a `datasets.save_to_disk` dataset): "
                             f"install the `datasets` library to read it") from None
        ds = datasets.load_from_disk(path)
        if not isinstance(ds, datasets.Dataset):
            raise ValueError(f"data file {path!r} holds splits {list(ds)}, expected one Dataset: give the split's "
                             f"directory ({path}/<split>)")
        return [(f"{path}, row {i}", dict(r)) for i, r in enumerate(ds)]
    if path.endswith(".jsonl"):
        out = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {n}: not JSON ({err})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}, line {n}: {type(record).__name__}, expected a JSON object")
                out.append((f"{path}, line {n}", record))
        return out
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"data file {path!r} is parquet: install pyarrow to read it") from None
        return [(f"{path}, row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    raise ValueError(f"data file {path!r}: unknown extension, expected .jsonl, .parquet or a "
                     f"`datasets.save_to_disk` directory")


def _first_record(path: str) -> tuple[str, dict]:
    """(where, record) of `path`'s first record, without reading the rest (jsonl: its first object; parquet:
    its first row; a datasets directory: its first row): the composition-time check of a data file."""
    if not os.path.isdir(path) and path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}, line {n}: not JSON ({err})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{path}, line {n}: {type(record).__name__}, expected a JSON object")
                    return f"{path}, line {n}", record
        raise ValueError(f"data file {path!r} holds no records, expected one JSON object per line")
    if not os.path.isdir(path) and path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"data file {path!r} is parquet: install pyarrow to read it") from None
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
            return f"{path}, row 0", batch.to_pylist()[0]
        raise ValueError(f"data file {path!r} holds no rows")
    records = _read_records(path)[:1]
    if not records:
        raise ValueError(f"data file {path!r} holds no rows")
    return records[0]


VERL_LABEL = "reward_model.ground_truth"
"""verl's label column (a struct column `reward_model` with a `ground_truth` field)."""
VERL_EXTRAS = ("data_source", "extra_info", "ability")
"""verl's columns a row carries when its file has them (verl's reward functions read them)."""
_ABSENT = object()


def lookup(record: dict, key: str) -> object:
    """`record[key]`, or the nested value a dotted `key` names ("reward_model.ground_truth"); a key that
    exists literally (dots and all) wins. _ABSENT when there is none."""
    if key in record:
        return record[key]
    value: object = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def label_key(config: DataConfig, record: dict) -> str | None:
    """The label column of a file whose first record is `record`: data.label_key, except that the default
    ("label") falls back to verl's reward_model.ground_truth when the record has no "label"."""
    if config.label_key == "label" and "label" not in record and lookup(record, VERL_LABEL) is not _ABSENT:
        return VERL_LABEL
    return config.label_key


def _columns(record: dict, prefix: str = "") -> list[str]:
    """Every key of `record`, nested ones as dotted paths (for error messages)."""
    out = []
    for k, v in record.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += _columns(v, prefix + k + ".")
    return out


def check_files(config: DataConfig) -> None:
    """Composition-time check of every data file: it exists, its format is readable, and its first
    record (its schema for parquet and datasets directories) has the prompt, label and extra columns.
    A later record lacking one is reported by `load_rows` (the run's build, before anything is written)."""
    for key in ("train_files", "val_files"):
        missing = [f for f in getattr(config, key) if not os.path.exists(f)]
        if missing:
            raise ValueError(f"data.{key}: {missing} do not exist (relative paths are from the current directory, "
                             f"{os.getcwd()}); expected .jsonl or .parquet files or `datasets.save_to_disk` "
                             f"directories")
        for path in getattr(config, key):
            if not (os.path.isdir(path) or path.endswith((".jsonl", ".parquet"))):
                raise ValueError(f"data.{key}: {path!r} has an unknown extension, expected .jsonl, .parquet or a "
                                 f"`datasets.save_to_disk` directory")
            where, record = _first_record(path)
            wanted = {"data.prompt_key": config.prompt_key, "data.label_key": label_key(config, record)}
            wanted |= {f"data.extra_keys[{i}]": k for i, k in enumerate(config.extra_keys)}
            for name, column in wanted.items():
                if column is not None and lookup(record, column) is _ABSENT:
                    raise ValueError(f"{name}={column!r}, but {where} has no such key (it has {sorted(_columns(record))}; "
                                     f"a nested key is named by its dotted path)"
                                     + ("; set data.label_key=null if your rows have no label"
                                        if name == "data.label_key" else ""))


def _check_prompt(where: str, key: str, prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if (isinstance(prompt, list) and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt)):
        return
    raise ValueError(f"{where}: {key}={prompt!r:.80}, expected a string or a non-empty list of "
                     f'{{"role": str, "content": str}} messages')


def load_rows(files: list[str], config: DataConfig,
              encode: Callable[[str | list[dict]], list[int]] | None = None) -> LoadedRows:
    """The rows of `files` (in order), each {"prompt", "label", *extra_keys}. `encode(prompt)` gives a
    prompt's token ids as the driver will send them; it is needed (and only used) with
    config.max_prompt_tokens. Raises on a missing file, an unknown format, a record lacking a column
    (naming file, line/row and key), a malformed prompt, or no rows at all."""
    if config.max_prompt_tokens is not None and encode is None:
        raise ValueError(f"max_prompt_tokens={config.max_prompt_tokens} needs the tokenizer: pass `encode`")
    if not files:
        raise ValueError("no data files given, expected at least one .jsonl, .parquet or dataset directory")
    out = LoadedRows([])
    for path in files:
        records = _read_records(path)
        label = label_key(config, records[0][1]) if records else config.label_key
        keys = {PROMPT: config.prompt_key} | ({LABEL: label} if label else {}) | {k: k for k in config.extra_keys}
        for where, record in records:
            row = {name: lookup(record, column) for name, column in keys.items()}
            missing = [keys[name] for name, value in row.items() if value is _ABSENT]
            if missing:
                raise ValueError(f"{where}: no key {missing[0]!r} (the record has {sorted(_columns(record))})")
            row |= {k: record[k] for k in VERL_EXTRAS if k in record and k not in row}
            row.setdefault(LABEL, None)
            _check_prompt(where, config.prompt_key, row[PROMPT])
            if config.max_prompt_tokens is not None and len(encode(row[PROMPT])) > config.max_prompt_tokens:
                out.num_dropped_too_long += 1
                continue
            out.rows.append(row)
    if not out.rows:
        raise ValueError(f"no rows in {files}" + (f" ({out.num_dropped_too_long} longer than max_prompt_tokens="
                                                   f"{config.max_prompt_tokens})" if out.num_dropped_too_long else ""))
    return out


class RowSampler:
    """Rows in a deterministic order over epochs: `self[i]` is row i of that order (epoch i // n,
    shuffled by (seed, epoch) when `shuffle`); `take()` returns `self[position]` and advances.
    Raises DataExhausted past `epochs` epochs."""

    def __init__(self, rows: list[dict], *, shuffle: bool = True, seed: int = 0, epochs: int | None = None) -> None:
        if not rows:
            raise ValueError("RowSampler needs at least one row")
        self.rows, self.shuffle, self.seed, self.epochs = list(rows), shuffle, seed, epochs
        self.position = 0
        """Global index of the next row `take` returns (epoch * len(rows) + index)."""
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation), the last one used

    @classmethod
    def from_config(cls, config: DataConfig, encode=None) -> tuple[RowSampler, LoadedRows]:
        """The training rows' sampler under `config`, and the load's result (its drop count)."""
        loaded = load_rows(config.train_files, config, encode)
        return cls(loaded.rows, shuffle=config.shuffle, seed=config.seed, epochs=config.epochs), loaded

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> list[int]:
        """Row indices in epoch `epoch`'s order."""
        cached = self._order  # read once: environment worker threads index rows too (rl/episodes/env_runner.py)
        if cached is None or cached[0] != epoch:
            perm = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"rows/{self.seed}/{epoch}").shuffle(perm)  # str seeds do not depend on PYTHONHASHSEED
            self._order = cached = (epoch, perm)
        return cached[1]

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            raise IndexError(f"row index {i}, expected >= 0")
        epoch, index = divmod(i, len(self.rows))
        if self.epochs is not None and epoch >= self.epochs:
            raise DataExhausted(f"row {i}: all {self.epochs} epoch(s) of {len(self.rows)} rows were used")
        return self.rows[self.order(epoch)[index]]

    def take(self) -> dict:
        """The row at `position`, which then advances; DataExhausted (position unchanged) past the last epoch."""
        row = self[self.position]
        self.position += 1
        return row

    def state_dict(self) -> dict:
        epoch, index = divmod(self.position, len(self.rows))
        return {"epoch": epoch, "index": index}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["index"] < len(self.rows) or state["epoch"] < 0:
            raise ValueError(f"sampler state {state}, expected epoch >= 0 and 0 <= index < {len(self.rows)} rows "
                             f"(did the data files change?)")
        self.position = state["epoch"] * len(self.rows) + state["index"]

