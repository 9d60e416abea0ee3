"""Where a model's tokenizer files are: a local directory, or a Hugging Face id in the local hub cache.

The proxy never downloads: with a model id it reads the snapshot the engine already downloaded into
the shared Hugging Face cache (the compose file mounts one volume into both), so the two tokenize
from the same files. `org/name@revision` pins a revision (a commit hash or a ref such as `main`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from proxy.errors import ProxyError

# A hub id as the hub spells it: `name` or `org/name`, letters, digits, `-`, `_` and `.`.
_MODEL_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


class ModelSourceError(ProxyError):
    """The tokenizer is neither a directory nor a model id found in the local hub cache."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved tokenizer location and the name the model goes by."""

    directory: Path
    name: str  # the hub id for a hub model; the directory's name otherwise


def hub_cache() -> Path:
    """The hub cache the way huggingface_hub finds it (HF_HUB_CACHE, HF_HOME, ~/.cache/huggingface)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def resolve(reference: str | Path, cache: Path | None = None) -> ModelSource:
    """The directory for `reference`: an existing directory wins; else a hub id looked up offline."""
    text = str(reference)
    local = Path(text).expanduser()
    if local.is_dir():
        return ModelSource(directory=local, name=local.resolve().name)
    model_id, _, revision = text.partition("@")
    if not _MODEL_ID.match(model_id) or text.startswith(("/", ".", "~")):
        raise ModelSourceError(f"{text}: no such directory, and not a Hugging Face model id")
    snapshot = _snapshot(cache or hub_cache(), model_id, revision or "main")
    return ModelSource(directory=snapshot, name=model_id)


def _snapshot(cache: Path, model_id: str, revision: str) -> Path:
    repo = cache / ("models--" + model_id.replace("/", "--"))
    if not repo.is_dir():
        raise ModelSourceError(
            f"{model_id} is not in the Hugging Face cache at {cache} (the proxy does not download: let "
            "the engine download it into a cache shared with the proxy, or pass a directory)"
        )
    ref = repo / "refs" / revision
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelSourceError(f"{model_id}: revision {revision!r} has no snapshot in {repo}")
    return snapshot


def routed_experts_shape(declared: str | None, directories: Iterable[Path | None]) -> tuple[int, int] | None:
    """(layers, top_k) of a MoE model: `LAYERS,TOP_K` as declared, else its config.json's
    num_hidden_layers and num_experts_per_tok (what SGLang sizes its routing buffers by)."""
    if declared:
        layers, _, top_k = declared.replace("x", ",").partition(",")
        return int(layers), int(top_k)
    for directory in directories:
        config_file = directory / "config.json" if directory is not None else None
        if config_file is None or not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        layers, top_k = text.get("num_hidden_layers"), text.get("num_experts_per_tok")
        if isinstance(layers, int) and isinstance(top_k, int):
            return layers, top_k
    return None
