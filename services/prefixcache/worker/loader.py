"""Load a local Hugging Face Llama-family checkpoint (one or several safetensors files).

Fails before allocating anything when the directory lacks a file, names an architecture we do not
run, or holds a config we cannot serve; while loading, on a tensor the model has no place for or of
the wrong shape; after loading, when a weight is missing. Prints a progress line while tensors are
copied. Never contacts a model hub.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from safetensors import SafetensorError, safe_open

from prefixcache.worker.model_config import ModelConfig, read_json_file
from prefixcache.worker.models.llama import LlamaForCausalLM

SHARD_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    model_id: str  # "<directory name>@sha256:<16 hex>": names the exact weights


@dataclass(frozen=True)
class Checkpoint:
    """A model directory that passed every check short of reading its tensors."""

    directory: Path
    config: ModelConfig
    files: list[Path]

    def model_id(self) -> str:
        """"<directory name>@sha256:<16 hex>" from a digest of the weight files (reads them all)."""
        return f"{self.directory.name}@sha256:{_digest(self.files)[:16]}"


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> str:
    """`name`, or for "auto" the dtype `device` serves best (`auto_dtype`)."""
    if name == "auto":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return auto_dtype(device.type, capability)
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return name


def auto_dtype(device_type: str, compute_capability: tuple[int, int] | None) -> str:
    """bfloat16 on GPUs with bfloat16 tensor cores (compute capability 8.0 on: A100, L4, H100, ...), where
    it halves the KV cache and is what everyone serves in; float32 elsewhere: on CPU, where greedy tokens
    then equal transformers' exactly, and on older GPUs, which have no fast bfloat16."""
    if device_type == "cuda" and compute_capability is not None and compute_capability >= (8, 0):
        return "bfloat16"
    return "float32"


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from its shard index when it has one, else
    `model.safetensors`, else every `*.safetensors` (shards named without an index)."""
    index_path = model_dir / SHARD_INDEX
    if index_path.is_file():
        index = read_json_file(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map \
                or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{index_path}: needs a non-empty \"weight_map\" of tensor name to shard file name")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: {SHARD_INDEX} lists shards that are missing: {', '.join(missing)}")
        return files
    if (model_dir / SINGLE_FILE).is_file():  # transformers reads only this; others (adapters, say) are not ours
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f" (found {', '.join(other)}; convert them to safetensors)" if other else ""
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights{hint}")
    return files


def inspect_checkpoint(model_dir: str | Path) -> Checkpoint:
    """The directory, its config, its weight files and their tensor names, checked without reading
    a tensor: what fails here fails fast (`FileNotFoundError` or `ValueError` saying what is wrong)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is a file, not a directory" if model_dir.exists() else "does not exist"
        raise FileNotFoundError(f"model directory {model_dir} {what}")
    config = ModelConfig.from_model_dir(model_dir)
    files = weight_files(model_dir)
    with torch.device("meta"):
        expected = LlamaForCausalLM(config).expected_checkpoint_names()
    _check_complete(model_dir, files, expected)
    return Checkpoint(model_dir, config, files)


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
               progress: TextIO | None = None) -> LoadedModel:
    """Load the checkpoint, reporting progress on `progress` (default: this process's stderr now)."""
    progress = progress or sys.stderr
    torch_dtype = parse_dtype(dtype)
    checkpoint = inspect_checkpoint(model_dir)
    files = checkpoint.files
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.config)
    model = model.to(torch_dtype).to_empty(device=device).eval()  # cast while on meta: no memory twice
    reporter = _Progress(sum(path.stat().st_size for path in files), progress)
    tied_head_in_checkpoint = None
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                tensor = shard.get_tensor(name)
                if name == "lm_head.weight" and checkpoint.config.tie_word_embeddings:
                    tied_head_in_checkpoint = tensor
                else:
                    model.load_weight(name, tensor)
                reporter.advance(tensor.numel() * tensor.element_size())
    reporter.finish()
    if tied_head_in_checkpoint is not None:
        model.untie_head_if_it_differs(tied_head_in_checkpoint)
    if torch.device(device).type == "cpu":
        model.lay_out_for_cpu()
    return LoadedModel(model=model, config=checkpoint.config, model_id=checkpoint.model_id())


def _check_complete(model_dir: Path, files: list[Path], expected: set[str]) -> None:
    """Fail before reading any tensor if the files' headers lack a weight the model needs."""
    present: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as checkpoint:
                present.update(checkpoint.keys())
        except SafetensorError as error:  # truncated or not safetensors at all
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    if missing := expected - present:
        names = sorted(missing)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(f"{model_dir}: checkpoint lacks {len(names)} weight(s): {shown}")


def _digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


class _Progress:
    """`loading weights: 42% (215/513 MiB)`: redrawn in place on a terminal, a line per quarter otherwise."""

    def __init__(self, total_bytes: int, stream: TextIO | None) -> None:
        self.total = max(total_bytes, 1)
        self.done = 0
        self.stream = stream
        self.step = 1 if stream and stream.isatty() else 25  # percent between reports
        self.next_report = self.step

    def advance(self, num_bytes: int) -> None:
        self.done = min(self.done + num_bytes, self.total)
        if self.done * 100 >= self.next_report * self.total:
            self._report("\r" if self.step == 1 else "\n")
            self.next_report = self.done * 100 // self.total // self.step * self.step + self.step

    def finish(self) -> None:
        self.done = self.total  # file sizes include headers, tensor bytes do not
        self._report("\n")

    def _report(self, end: str) -> None:
        if self.stream:
            print(f"loading weights: {self.done * 100 // self.total:3d}% "
                  f"({self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB)", end=end, file=self.stream, flush=True)
