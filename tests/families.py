"""Template fixtures for every family: real chat templates from the trl wheel on PyPI, with the real
Qwen vocabulary, extended offline with each family's special tokens where they are not Qwen's.

The wheel is fetched once into a cache outside the repository (scripts/test does it; this module
does it too when run alone) and read from there, so the suite runs offline once it is cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from proxy.demo_model import qwen_tokenizer_source

TRL_VERSION = "1.16.0"


def cache_dir() -> Path:
    return Path(os.environ.get("TITO_TEST_CACHE", Path.home() / ".cache" / "tito-proxy"))


@cache
def trl_wheel() -> Path:
    wheels = cache_dir() / "wheels"
    wheel = wheels / f"trl-{TRL_VERSION}-py3-none-any.whl"
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                f"trl=={TRL_VERSION}",
                "-d",
                str(wheels),
            ],
            check=True,
        )
    return wheel


def trl_template(name: str) -> str:
    with zipfile.ZipFile(trl_wheel()) as archive:
        return archive.read(f"trl/chat_templates/{name}.jinja").decode()


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file name in trl/chat_templates
    eos: str
    bos: str | None = None
    specials: tuple[str, ...] = ()  # added as special tokens
    added: tuple[str, ...] = ()  # added as ordinary (non-special) tokens
    tools: bool = True  # the template renders tools and tool results
    system_appends_continue: bool = True
    tool_appends_continue: bool = True
    user_appends_continue: bool = True
    extra_config: dict[str, object] = field(default_factory=dict)


LLAMA_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
DEEPSEEK_SPECIALS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("qwen2_5", "qwen2_5", eos="<|im_end|>"),
        Family("qwen3", "qwen3", eos="<|im_end|>"),
        Family("nemotron", "nemotron_3_nano", eos="<|im_end|>"),
        Family("llama3_1", "llama3_1", eos="<|eot_id|>", bos="<|begin_of_text|>", specials=LLAMA_SPECIALS),
        Family("llama3_2", "llama3_2", eos="<|eot_id|>", bos="<|begin_of_text|>", specials=LLAMA_SPECIALS),
        # Its template opens tool outputs only for the first batch of a conversation: tool appends split.
        Family(
            "deepseek_v3",
            "deepseekv3",
            eos="<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
            specials=DEEPSEEK_SPECIALS,
            system_appends_continue=False,
            tool_appends_continue=False,
        ),
        Family(
            "deepseek_r1",
            "deepseek_r1_distill",
            eos="<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
            specials=DEEPSEEK_SPECIALS,
            tools=False,
            system_appends_continue=False,
        ),
        Family(
            "glm4_moe",
            "glm4moe",
            eos="<|endoftext|>",
            specials=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
            added=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ),
        Family(
            "gpt_oss",
            "gptoss",
            eos="<|return|>",
            specials=(
                "<|start|>",
                "<|end|>",
                "<|message|>",
                "<|channel|>",
                "<|return|>",
                "<|call|>",
                "<|constrain|>",
                "<|startoftext|>",
            ),
            system_appends_continue=False,
        ),
        Family(
            "gemma3",
            "gemma3",
            eos="<end_of_turn>",
            bos="<bos>",
            specials=("<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"),
            tools=False,
            system_appends_continue=False,
        ),
        Family(
            "phi3",
            "phi3",
            eos="<|endoftext|>",
            specials=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
            tools=False,
        ),
        Family(
            "mistral_style",
            "mistral_style",
            eos="</s>",
            bos="<s>",
            specials=(
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            # It drops system messages after the first: a system append cannot continue.
            user_appends_continue=False,
            system_appends_continue=False,
        ),
        Family(
            "mistral_nemo_style",
            "mistral_nemo_style",
            eos="</s>",
            bos="<s>",
            specials=(
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            user_appends_continue=False,
            system_appends_continue=False,
        ),
    ]
}


# Written for these tests (no Mistral template ships in a wheel here): like Mistral's, it puts the
# system prompt inside the *last* user message, so appending a user message moves it.
MISTRAL_STYLE = """
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in loop_messages %}
{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if loop.index0 == ns.last_user and system_message is defined %}
{{- '[INST] ' + system_message + '\n\n' + message.content + '[/INST]' }}
{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{%- if message.tool_calls %}
{{- '[TOOL_CALLS] ' + (message.tool_calls | map(attribute='function') | list | tojson) }}
{%- else %}{{- ' ' + message.content }}{%- endif %}{{- eos_token }}
{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS] ' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# Like Mistral-Nemo's: the system prompt goes into a user message only when it is the very last
# message, so a history render that ends with the assistant's reply holds no system prompt at all.
MISTRAL_NEMO_STYLE = MISTRAL_STYLE.replace(
    "loop.index0 == ns.last_user and system_message is defined", "loop.last and system_message is defined"
)
OWN_TEMPLATES = {"mistral_style": MISTRAL_STYLE, "mistral_nemo_style": MISTRAL_NEMO_STYLE}


# Written for these tests after Mistral-Nemo-Instruct-2407's template, whose behaviour it keeps (no
# wheel available here ships a Mistral template): strict user/assistant alternation (tool turns
# aside); the system prompt written into the user message only when that message is the last one;
# the tool list before the last user message; calls as `[TOOL_CALLS][{"name", "arguments", "id"}]`
# and results as `[TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS]`; and, as in every
# Mistral template since v3, any call id that is not nine characters refused with the real message.
# Checked against the original: the same text on conversations with and without tools and calls.
MISTRAL_NEMO = """
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{%- set ns = namespace(turn=0) %}
{%- for message in loop_messages %}
{%- if not (message.role == 'tool' or (message.tool_calls is defined and message.tool_calls is not none)) %}
{%- if (message.role == 'user') != (ns.turn % 2 == 0) %}
{{- raise_exception('After the optional system message, conversation roles must alternate '
    ~ 'user/assistant/user/assistant/...') }}
{%- endif %}{%- set ns.turn = ns.turn + 1 %}
{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools is not none and tools is defined and message == user_messages[-1] %}
{{- '[AVAILABLE_TOOLS][' }}
{%- for tool in tools %}{{- '{"type": "function", "function": {' }}
{%- for key, val in tool.function.items() if key != 'return' %}
{{- '"' + key + '": ' + ('"' + val + '"' if val is string else val | tojson) }}{{- ', ' if not loop.last }}
{%- endfor %}{{- '}}' }}{{- ', ' if not loop.last else ']' }}
{%- endfor %}{{- '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- '[INST]' + system_message + '\n\n' + message.content + '[/INST]' }}
{%- else %}{{- '[INST]' + message.content + '[/INST]' }}{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- '[TOOL_CALLS][' }}
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '{"name": ' + (call.function.name | tojson) + ', "arguments": ' + (call.function.arguments | tojson) }}
{{- ', "id": "' + call.id + '"}' }}{{- ', ' if not loop.last else ']' + eos_token }}
{%- endfor %}
{%- elif message.role == 'assistant' %}{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '[TOOL_RESULTS]{"content": ' + message.content | string }}
{{- ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial '
    ~ 'optional system message!') }}
{%- endif %}
{%- endfor %}
"""
MISTRAL_SPECIALS = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
# Not in FAMILIES: its strict user/assistant alternation refuses the generic conversations those
# tests run (a system append, two user messages in a row); the tool-call fidelity tests use it.
MISTRAL_NEMO_FAMILY = Family(
    "mistral_nemo",
    "mistral_nemo",
    eos="</s>",
    bos="<s>",
    specials=MISTRAL_SPECIALS,
    user_appends_continue=False,
    system_appends_continue=False,
)
OWN_TEMPLATES["mistral_nemo"] = MISTRAL_NEMO


def build_tokenizer_dir(family: Family, target: Path) -> Path:
    """A tokenizer dir for `family`: Qwen's BPE vocabulary plus the family's special tokens."""
    tokenizer_json, config = _family_files(family)
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (target / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return target


# Built once per family and test process: parsing and saving the vocabulary takes a second or more.
_BUILT: dict[str, tuple[str, str]] = {}


def _family_files(family: Family) -> tuple[str, str]:
    """The family's tokenizer.json and tokenizer_config.json texts."""
    key = repr(family)
    if key in _BUILT:
        return _BUILT[key]
    source = qwen_tokenizer_source()
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    # Registered as added tokens even when the BPE vocabulary has the same piece (`<s>` in Qwen's).
    added = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
    missing = [t for t in family.specials if t not in added]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    plain = [t for t in family.added if t not in added]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": OWN_TEMPLATES.get(family.template) or trl_template(family.template),
        "eos_token": family.eos,
        "bos_token": family.bos,
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        **family.extra_config,
    }
    _BUILT[key] = (tokenizer.to_str(), json.dumps(config, ensure_ascii=False, indent=1))
    return _BUILT[key]
