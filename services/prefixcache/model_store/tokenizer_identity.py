"""Which tokenizer a model directory holds, so that the scheduler can tell when the tokenizer service
and the worker serve different models (a misconfigured address, or a model change halfway rolled out)
before a prompt's ids reach weights they were not made for."""
from __future__ import annotations

import hashlib
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_id(model_dir: str | Path) -> str:
    """"sha256:<16 hex>" of the directory's tokenizer.json; "" when it has none (nothing to compare)."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return ""
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def same_tokenizer(served: str, expected: str) -> bool:
    """Whether ids from the `served` tokenizer fit a model expecting `expected`; an unknown side
    (empty) cannot be checked and passes."""
    return not served or not expected or served == expected
