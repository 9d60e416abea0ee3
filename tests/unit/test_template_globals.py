"""A chat template sees Jinja's and the proxy's globals, and a render's own variables over them, as
Jinja's own environment gives them (proxy/chat/template.py keeps the globals as one flat dict)."""

from __future__ import annotations

from datetime import datetime

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.chat.template import ChatTemplate
from proxy.errors import TemplateError

NOW = datetime(2031, 7, 8, 9, 10)
SOURCE = (
    "{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}"
    "{{ ns.n }}|{{ dict(a=1)['a'] }}|{% set c = cycler('x', 'y') %}{{ c.next() }}{{ c.next() }}|"
    "{% set j = joiner('+') %}{% for m in messages %}{{ j() }}{{ m.role }}{% endfor %}|"
    "{{ strftime_now('%Y') }}|{{ bos_token }}|{{ enable_thinking }}"
    "{% if messages[-1].role == 'boom' %}{{ raise_exception('refused') }}{% endif %}"
)


@pytest.mark.parametrize("sandbox", [None, ImmutableSandboxedEnvironment])
def test_globals_and_variables_render_as_jinja_gives_them(
    sandbox: type[ImmutableSandboxedEnvironment] | None,
) -> None:
    template = (
        ChatTemplate(SOURCE, {"bos_token": "<s>"})
        if sandbox is None
        else ChatTemplate(SOURCE, {"bos_token": "<s>"}, sandbox=sandbox)
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    # `now` pins strftime_now over the global one; a kwarg is a variable like the special tokens.
    text = template.render(messages, template_kwargs={"enable_thinking": False}, now=NOW)
    assert text == "3|1|xy|user+assistant|2031|<s>|False"
    assert template.render(messages).split("|")[4] == datetime.now().strftime("%Y")
    with pytest.raises(TemplateError, match="refused"):
        template.render([{"role": "boom", "content": ""}])
