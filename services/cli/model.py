"""`prefixcache model pull|show`: fetch and convert the embedded model, or describe a model directory."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.services.common import model_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull = actions.add_parser("pull", help="download and convert the default model; print its directory")
    pull.add_argument("--model-dir", type=Path, default=None,
                      help=f"where to put the converted model (default: models/ under ${model_store.HOME_ENV}, "
                           "itself ~/.cache/prefixcache by default)")
    show = actions.add_parser("show", help="print a model directory's architecture and size")
    show.add_argument("--model-dir", type=Path, default=None,
                      help="a Hugging Face model directory (default: the converted default model)")


def run(args: argparse.Namespace) -> int:
    if args.action == "pull":
        print(model_store.ensure_default_model(args.model_dir))
        return 0
    return _show(args.model_dir or model_store.default_model_dir())


def _show(model_dir: Path) -> int:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        print(f"no model at {model_dir} (config.json missing); run `prefixcache model pull`", file=sys.stderr)
        return 1
    config = json.loads(config_path.read_text())
    weights = sorted(model_dir.glob("*.safetensors"))
    rows = {
        "directory": str(model_dir),
        "architecture": ", ".join(config.get("architectures", [])) or "?",
        "layers": config.get("num_hidden_layers"),
        "hidden size": config.get("hidden_size"),
        "heads (query/kv)": f"{config.get('num_attention_heads')}/{config.get('num_key_value_heads')}",
        "vocab size": config.get("vocab_size"),
        "max positions": config.get("max_position_embeddings"),
        "weights": f"{len(weights)} safetensors file(s), {sum(p.stat().st_size for p in weights) / 2**20:.1f} MiB",
    }
    width = max(map(len, rows))
    for name, value in rows.items():
        print(f"{name:<{width}}  {value}")
    return 0
