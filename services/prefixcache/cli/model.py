"""`prefixcache model pull|show`: fetch and convert the embedded model, or describe a model directory."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefixcache.model_store import store as model_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull = actions.add_parser("pull", help="download and convert the default model; print its directory")
    pull.add_argument("--model-dir", type=Path, default=None,
                      help=f"where to put the converted model (default: models/ under ${model_store.HOME_ENV}, "
                           "itself ~/.cache/prefixcache by default)")
    show = actions.add_parser("show", help="check a model directory as the worker would; print its architecture, "
                                           "size and model id")
    show.add_argument("--model-dir", type=Path, default=None,
                      help="a Hugging Face model directory (default: the converted default model)")


def run(args: argparse.Namespace) -> int:
    if args.action == "pull":
        print(model_store.ensure_default_model(args.model_dir))
        return 0
    return _show(args.model_dir or model_store.default_model_dir(), is_default=args.model_dir is None)


def _show(model_dir: Path, is_default: bool) -> int:
    from prefixcache.worker.loader import inspect_checkpoint

    try:
        checkpoint = inspect_checkpoint(model_dir)
    except (OSError, ValueError) as error:
        hint = "; run `prefixcache model pull`" if is_default and not model_dir.exists() else ""
        print(f"error: {error}{hint}", file=sys.stderr)
        return 1
    if not (model_dir / "tokenizer.json").is_file():
        print(f"error: {model_dir}: no tokenizer.json (the tokenizer service needs it)", file=sys.stderr)
        return 1
    config, files = checkpoint.config, checkpoint.files
    rows = {
        "directory": str(model_dir),
        "model id": checkpoint.model_id(),  # what block-hashes --model-id takes
        "architecture": config.architecture,
        "layers": config.num_layers,
        "hidden size": config.hidden_size,
        "heads (query/kv)": f"{config.num_heads}/{config.num_kv_heads}",
        "vocab size": config.vocab_size,
        "max model length": config.max_model_len,
        "weights": f"{len(files)} safetensors file(s), {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB",
    }
    width = max(map(len, rows))
    for name, value in rows.items():
        print(f"{name:<{width}}  {value}")
    return 0
