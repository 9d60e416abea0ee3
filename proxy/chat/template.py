"""Renders a chat template exactly as transformers' apply_chat_template does, with a pinned clock.

The Jinja environment mirrors transformers (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, the
same tojson/raise_exception/strftime_now helpers, reasoning fields aliased), so that our renders are
byte-identical; tests assert that parity against transformers on every fixture template.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.chat.tojson import CachedToJson
from proxy.errors import TemplateError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
_JINJA_NAMES = ("loop", "caller", "varargs", "kwargs", "range", "dict", "lipsum", "cycler", "joiner")


def _strftime_now(fmt: str, now: datetime | None = None) -> str:
    return (now or datetime.now()).strftime(fmt)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without dunder attributes, as in transformers."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _dict_attribute(name: str) -> bool:
    """Whether a dict instance has attribute `name` (all of a dict's attributes are its type's)."""
    found = _DICT_ATTRIBUTES.get(name)
    if found is None:
        found = _DICT_ATTRIBUTES[name] = hasattr({}, name)
    return found


_DICT_ATTRIBUTES: dict[str, bool] = {}
# The str methods the sandbox hands out unchanged: public, and not format/format_map (which it wraps).
_STR_METHODS = frozenset(
    name for name in dir(str) if not name.startswith("_") and name not in ("format", "format_map")
)


_PLAIN_VALUES = frozenset({bool, int, float, str, type(None)})
_STATE_OBJECTS = frozenset({jinja2.runtime.LoopContext, _Namespace})


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox transformers uses, with shortcuts for the lookups templates make most, each
    returning what the sandbox itself returns: `message.role` on a dict (the sandbox first tries the
    attribute, which a dict lacks, then the key), a public str method such as `content.strip`, and
    loop or namespace state (which its checks always allow). Half a render went to those checks."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and not _dict_attribute(attribute):
            try:
                return obj[attribute]
            except LookupError:
                return self.undefined(obj=obj, name=attribute)
        if kind is str and attribute in _STR_METHODS:
            return getattr(obj, attribute)
        if kind in _STATE_OBJECTS and not attribute.startswith("_"):
            # `loop.last`, `ns.last_query_index`: the sandbox lets any public attribute of these
            # through, and a plain value needs no wrapping.
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            if type(value) in _PLAIN_VALUES:
                return value
        return super().getattr(obj, attribute)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}` blocks (used by training templates) and renders their body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _alias_reasoning(message: Mapping[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One compiled chat template plus the special-token variables it reads."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        *,
        sandbox: type[ImmutableSandboxedEnvironment] = _SandboxEnvironment,
    ) -> None:
        """`sandbox`: Jinja's own ImmutableSandboxedEnvironment gives the reference renders in tests."""
        self.source = source
        self._special_tokens = dict(special_tokens)
        env = sandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        # Per template: the dumps it keeps are bounded with it.
        self.tojson = CachedToJson()
        env.filters["tojson"] = self.tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = dict
        env.globals["namespace"] = _Namespace
        self._ast = env.parse(source)
        self._compiled = env.from_string(self._ast)
        # Jinja keeps a template's globals as a ChainMap over its environment's, and every render
        # copies them into its context (dict(globals, **variables), then set(globals)), walking both
        # maps: a quarter of a short render. This environment is the template's own and its globals
        # are all set above, before compiling, so a flat copy is the same mapping.
        self._compiled.globals = dict(self._compiled.globals)
        self._globals = frozenset(env.globals)
        # Jinja's only sources of randomness: the `random` filter and the `lipsum` global.
        filters = {node.name for node in self._ast.find_all(jinja2.nodes.Filter)}
        names = {node.name for node in self._ast.find_all(jinja2.nodes.Name)}
        self.pure = "random" not in filters and "lipsum" not in names

    def optional_variables(self) -> frozenset[str]:
        """The names the template reads that nothing but a caller's chat_template_kwargs sets
        (Llama 3.1's builtin_tools, Qwen3's enable_thinking). A name the template also assigns
        does not count."""
        names = list(self._ast.find_all(jinja2.nodes.Name))
        read = {n.name for n in names if n.ctx == "load"} - {n.name for n in names if n.ctx != "load"}
        macros = {m.name for m in self._ast.find_all(jinja2.nodes.Macro)}
        return frozenset(
            read - macros - {*_JINJA_NAMES, *_RENDER_VARIABLES, *self._special_tokens, *self._globals}
        )

    @property
    def reads_date(self) -> bool:
        return "strftime_now" in self.source or "date_string" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> str:
        """Render to text; `now` pins what the template sees as today's date."""
        # Messages come in the template's shape (messages.for_template): None-valued keys already
        # dropped as transformers does, except a content the template needs to see as none.
        plain = [_alias_reasoning(m) for m in messages]
        variables: dict[str, Any] = {**self._special_tokens, **(template_kwargs or {})}
        if now is not None:
            # Per render, not on the instance: renders of large requests run on worker threads.
            variables["strftime_now"] = functools.partial(_strftime_now, now=now)
        try:
            return self._compiled.render(
                messages=plain,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(
                f"the chat template refused this conversation: {exc}", param="messages"
            ) from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            raise TemplateError(
                f"the chat template failed on this conversation: {exc}", param="messages"
            ) from exc
