"""A model folder's chat template renders within bounds: a hostile one is a located error of the
data gate, never a hang, a crash or memory exhausted (toolkit/data/chat_template.py)."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from toolkit.cli.app import app
from toolkit.data.chat_template import ChatTemplate, ChatTemplateError
from toolkit.data.tiny_tokenizer import TINY_CHAT_TEMPLATE

CONVERSATION = [{"role": "user", "content": "x" * 2000}, {"role": "assistant", "content": "fine"}]

HOSTILE = {
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      r"range\(\) items"),
    "loops that call nothing": ("{% set s = messages[0].content %}{% for a in s %}{% for b in s %}{% for c in s %}"
                                "{% endfor %}{% endfor %}{% endfor %}", "took more than"),
    "string repetition": ("{{ 'x' * 10**10 }}", "repeats a value"),
    "a huge power": ("{{ 7 ** 99999999 }}", "to the power"),
    "a filter asked for a huge string": ("{{ 'x' | center(10**10) }}", "asks a call for"),
    "a method asked for a huge string": ("{{ 'x'.ljust(10**10) }}", "asks a call for"),
    "doubling through a namespace": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                                     "stores a value|joins text of more than"),
    "a refused call": ("{{ messages.append(1) }}", "SecurityError"),
    "endless recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "a syntax error": ("{% for m in messages %}", "does not parse"),
    "formatting folded at compile time": ("{{ ('%0900000000d' % 1) | length }}", "wider than"),
    "a float formatted very wide": ("{{ '%.999999999f' % 1.0 }}", "wider than"),
    "an unknown codec": ("{{ messages[0].content.encode('nope') }}", "LookupError"),
    "a 5000-digit literal": ("{{ " + "9" * 5000 + " }}", "does not parse|failed"),
    # `~` in a plain variable (no namespace): 3 GB before the timer, in the first review.
    # Built past the bound by one call before the checks after it (the third review: ~1 GiB each).
    "a join filter of many copies": ("{% set s = messages[0].content %}{{ ([s] * 2100) | join }}", "joins text"),
    "a join method of many copies": ("{% set s = messages[0].content %}{{ ''.join([s] * 2100) }}", "makes text"),
    "replace with itself": ("{% set s = messages[0].content ~ messages[0].content %}{{ s.replace('x', s) }}",
                            "makes text"),
    "a replace filter with itself": ("{% set s = messages[0].content ~ messages[0].content %}"
                                     "{{ s | replace('x', s) }}", "makes text"),
    "a wide format method": ("{{ '{:>1073741824}'.format('x') }}", "makes text"),
    "a wide format filter": ("{{ '%1073741824s' | format('x') }}", "wider than"),
    "a deep indent": ("{% set s = messages[0].content ~ '\\n' * 2000 %}{{ s | indent(3000) }}", "indents into"),
    "a block set past the bound": ("{% set b %}{% for i in range(3000) %}{{ messages[0].content }}{% endfor %}"
                                   "{% endset %}{{ b | length }}", "renders more than"),
    "a macro's output past the bound": ("{% macro m() %}{% for i in range(3000) %}{{ messages[0].content }}"
                                        "{% endfor %}{% endmacro %}{{ m() | length }}", "renders more than"),
    "doubling with ~": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s | length }}{% endif %}"
                        "{% endmacro %}{{ d(messages[0].content, 40) }}", "joins text of more than"),
    "doubling with ~ into the output": ("{% for i in range(40) %}{{ messages[0].content ~ messages[0].content * 1000 "
                                        "~ messages[0].content * 1000 }}{% endfor %}",
                                        "joins text of more than|renders more than|repeats a value"),
}


# The thread method: pytest-timeout's signal method would hold the one interval timer, which the
# render uses on the main thread (as it does in ft, where nothing else holds it).
@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_template_fails_within_its_bounds(case):
    text, why = HOSTILE[case]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=why):
        ChatTemplate(text).render(CONVERSATION)
    assert time.monotonic() - started < 8  # RENDER_SECONDS and a margin


def test_a_real_template_renders_as_transformers_does():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
    expected = reference.from_string(TINY_CHAT_TEMPLATE).render(messages=CONVERSATION, add_generation_prompt=False)
    assert ChatTemplate(TINY_CHAT_TEMPLATE).render(CONVERSATION) == expected
    # The budget is per render: a thousand renders in a row are not one long one.
    template = ChatTemplate("{% for i in range(5000) %}{% endfor %}{{ messages | length }}")
    assert all(template.render(CONVERSATION) == "2" for _ in range(1000))


@pytest.mark.timeout(60, method="thread")
def test_the_data_gate_names_the_row_a_hostile_template_fails_on(tmp_path):
    from toolkit.data.tiny_tokenizer import train_tiny_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    train_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(HOSTILE["nested ranges"][0])
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(3)))
    result = CliRunner().invoke(app, ["data", "check", str(data), "--tokenizer", str(folder)], env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"{data}:1 messages: the model's chat template cannot render this conversation" in said
    assert said.count("chat template cannot render") == 1  # once, not once per row


@pytest.mark.timeout(60, method="thread")
def test_every_render_of_one_conversation_shares_one_budget():
    """Training renders each prefix of a conversation: 20,000 short turns were 20,000 budgets (the third
    review: 22.8 s for one row). One conversation's renders now share RENDER_SECONDS."""
    from toolkit.data import chat_template

    template = ChatTemplate("{% for m in messages %}{% for i in range(200) %}{% endfor %}{{ m.content }}{% endfor %}")
    turns = [{"role": "user", "content": "a"}] * 4000
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="one conversation took more than|took more than"), \
            chat_template.row_budget():
        for end in range(1, len(turns) + 1):
            template.render(turns[:end])
    assert time.monotonic() - started < chat_template.RENDER_SECONDS + 3
