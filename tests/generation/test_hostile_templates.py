"""Hostile chat templates: no file access, no code, no hang, no huge allocation; every failure a TemplateError.
Real templates (fixtures and published Qwen/DeepSeek ones) render exactly as in jinja's plain sandbox."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from hostile_helpers import FIXTURES
from jinja2.sandbox import ImmutableSandboxedEnvironment
from shared_data import MODEL_CONFIGS

from qwen_runtime import cli
from qwen_runtime.cli_support import run_guarded
from qwen_runtime.errors import EXIT_CODES, ResourceLimitError, TemplateError
from qwen_runtime.text.chat import ChatTemplate, _raise_exception, _strftime_now, _tojson

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}, {"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds",
                                           "parameters": {"type": "object", "properties": {}}}}]

HOSTILE = {
    "class mro": "{{ ''.__class__.__mro__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__ }}",
    "joiner globals": "{{ joiner.__init__.__globals__.os }}",
    "lipsum globals": "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "namespace init": "{{ namespace.__init__.__globals__ }}",
    "self": "{{ self.__init__.__globals__ }}",
    "open": "{{ open('/etc/passwd').read() }}",
    "import": "{% import 'os' as os %}{{ os.system('id') }}",
    "include": "{% include '/etc/passwd' %}",
    "extends": "{% extends '/etc/passwd' %}",
    "mutate input": "{{ messages.append(1) }}",
    "huge range": "{% for x in range(10**9) %}{{ x }}{% endfor %}",
    "nested loops": "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}",
    "loop over a built string": "{% set s = 'a' * 1000 %}{% for a in s %}{% for b in s %}{% for c in s %}"
                                "{% endfor %}{% endfor %}{% endfor %}",
    "string repetition": "{{ 'a' * 10**9 }}",
    "string doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "list doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "power": "{{ 10 ** 10 ** 9 }}",
    "center": "{{ 'x'|center(10**9) }}",
    "indent": "{{ 'x\ny'|indent(10**9) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "format filter width": "{{ '%999999999d'|format(1) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "tojson indent": "{{ messages|tojson(indent=10**9) }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "output flood": "{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}",
    "division by zero": "{{ 1 / 0 }}",
    "raise_exception": "{{ raise_exception('no system messages') }}",
    "syntax error": "{% for %}",
    "deep nesting": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_a_template_error(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    with pytest.raises(TemplateError) as info:
        ChatTemplate(HOSTILE[name]).render(MESSAGES)
    assert time.perf_counter() - started < 10
    assert "root:" not in str(info.value)  # nothing of /etc/passwd leaked into the message
    assert not list(tmp_path.iterdir())


# Small inputs, huge results: each is refused from its inputs' sizes, before the result is built.
S = "x" * (1 << 20)  # a 1 MiB message
AMPLIFIERS = {
    "replace filter": '{{ s|replace("x", "y" * 256) }}',
    "replace method": '{{ s.replace("x", s) }}',
    "join filter": "{{ ([s] * 1048576)|join }}",
    "join filter of an attribute": '{{ ([{"a": s}] * 1048576)|join(attribute="a") }}',
    "join of a lazy map": '{{ ([s] * 1048576)|map("upper")|join }}',
    "join method": '{{ "".join([s] * 1048576) }}',
    "printed list": "{{ [s] * 1048576 }}",
    "concatenated list": '{{ ([s] * 1048576) ~ "" }}',
    "string filter": "{{ ([s] * 1048576)|string }}",
    "tojson": "{{ ([s] * 1048576)|tojson }}",
    "tojson indent": "{{ ([1] * 1000000)|tojson(indent=1000000) }}",
    "indent": '{{ ("\n" * 1000000)|indent(1000000) }}',
    "indent by a string": '{{ ("\n" * 1000000)|indent(s) }}',
    "wordwrap": "{{ s|wordwrap(1, wrapstring=s) }}",
    "str.format": '{{ ("{0}" * 300000).format(s) }}',
    "str.format_map": '{{ ("{a}" * 300000).format_map({"a": s}) }}',
    "percent": '{{ ("%s" * 300000) % ((s,) * 300000) }}',
    "percent with a mapping": '{{ ("%(a)s" * 100000) % {"a": s} }}',
    "sum of lists (quadratic)": "{{ ([[1]] * 1000000)|sum(start=[]) }}",
    "translate": "{{ s.translate({120: s}) }}",
    "expandtabs": '{{ ("\t" * 1000000).expandtabs(1000000) }}',
}


@pytest.mark.parametrize("name", sorted(AMPLIFIERS))
def test_amplifying_operations_are_refused_before_allocating(name: str) -> None:
    template = ChatTemplate(AMPLIFIERS[name])
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match="limits protect against hostile templates"):
            template.render([], s=S)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{name}: {peak / 2**20:.0f} MiB allocated before the refusal"


def test_amplifiers_within_the_cap_render_as_in_the_plain_sandbox() -> None:
    s = "ab\tc\nd" * 1000
    for source in ['{{ s|replace("a", "xyz") }}', '{{ ([s] * 3)|join("-") }}', '{{ s.replace("b", s[:50]) }}',
                   "{{ s|indent(8) }}", '{{ ("{0}|" * 3).format(s) }}', '{{ "%s and %s" % (s, s) }}',
                   '{{ s.expandtabs(4) }}', "{{ [s, 1, none]|tojson(indent=2) }}", "{{ [s] * 3 }}",
                   "{{ ([[1, 2]] * 100)|sum(start=[]) }}", "{{ [1, 2.5]|sum }}"]:
        assert ChatTemplate(source).render([], s=s) == sandbox_render(source, s=s), source


def test_memory_error_while_rendering_is_a_template_error() -> None:
    def allocate() -> str:
        raise MemoryError

    with pytest.raises(TemplateError, match="out of memory while rendering"):
        ChatTemplate("{{ allocate() }}").render([], allocate=allocate)


def test_a_cli_refuses_an_amplifying_template_with_exit_code_7(tmp_path: Path, capsys) -> None:
    """qwen-run --chat on a model whose template would build a string of len(prompt)² characters."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "qwen3-tiny", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content.replace('x', messages[0].content) }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    code = cli.main([str(model), "--chat", "-p", "x" * 2000, "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 7 and err.count("\n") == 1
    assert err.startswith("qwen-run: error: chat template: str.replace of at least 4000000 characters")


def test_memory_error_anywhere_in_a_cli_is_one_line_and_the_memory_exit_code(capsys) -> None:
    def main() -> int:
        raise MemoryError

    assert run_guarded("qwen-x", main) == EXIT_CODES[ResourceLimitError] == 6
    assert capsys.readouterr().err == "qwen-x: error: out of memory\n"


def test_private_attributes_through_str_format_render_nothing() -> None:
    assert ChatTemplate("[{{ '{0.__class__}'.format('') }}]").render([]) == "[]"


def sandbox_render(source: str, **context: object) -> str:
    """The template rendered in jinja's plain immutable sandbox, configured like ChatTemplate."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source).render(**context)


def real_templates() -> dict[str, str]:
    found = {}
    for path in [*FIXTURES.glob("*/tokenizer_config.json"), *MODEL_CONFIGS.glob("*/tokenizer_config.json"),
                 *MODEL_CONFIGS.glob("_upstream-copies/*tokenizer_config*.json")]:
        template = json.loads(path.read_text()).get("chat_template")
        if isinstance(template, str):
            found[f"{path.parent.name}/{path.name}"] = template
    for path in [*MODEL_CONFIGS.glob("_upstream-copies/*.jinja"), *FIXTURES.glob("*/chat_template.jinja")]:
        found[path.name] = path.read_text()
    return found


@pytest.mark.parametrize("name", sorted(real_templates()))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_real_templates_render_as_in_the_plain_sandbox(name: str, tools: list | None) -> None:
    source = real_templates()[name]
    context = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>", tools=tools)
    assert ChatTemplate(source).render(MESSAGES, **context) == sandbox_render(source, messages=MESSAGES, **context)


def test_message_text_that_looks_like_a_format_width_is_only_text() -> None:
    source = real_templates()["qwen3-tiny/tokenizer_config.json"]
    messages = [{"role": "user", "content": "order {id 12345678} costs %1234567d"}]
    assert "order {id 12345678} costs %1234567d" in ChatTemplate(source).render(messages)


def test_budget_resets_between_renders() -> None:
    template = ChatTemplate("{% for i in range(9000) %}{% for j in range(10) %}{% endfor %}{% endfor %}ok")
    for _ in range(3):
        assert template.render([]) == "ok"
