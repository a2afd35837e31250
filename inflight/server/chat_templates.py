"""Which chat template renders a conversation.

A conversation without tools renders with `--chat-template` if the server was given one, else
with the model's own. One with tools (or with tool calls and results in its history) renders with
that same template when it reads a `tools` variable; otherwise (SmolLM2's template is plain
ChatML) with the ChatML template shipped here, which lists the tools in the system turn and asks
for calls in hermes syntax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta

HERMES_TEMPLATE = Path(__file__).with_name("templates") / "hermes.jinja"


@dataclass(frozen=True)
class ChatTemplates:
    plain: str | None  # for conversations without tools; None: the model's own
    tools: str | None  # for conversations with tools; None: the model's own
    shipped: bool  # `tools` is the hermes template shipped here
    # The variables the conversation template reads (its switches: enable_thinking, ...).
    variables: frozenset[str] = frozenset()


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def choose_templates(model_template: str | None, override: str | None) -> ChatTemplates:
    base = override or model_template
    variables = template_variables(base) if base else frozenset()
    if "tools" in variables:
        return ChatTemplates(override, override, shipped=False, variables=variables)
    return ChatTemplates(override, HERMES_TEMPLATE.read_text(), shipped=True, variables=variables)


def read_template(value: str) -> str:
    """`--chat-template`: a template file, or the template's text itself (as vLLM takes it)."""
    if "{" in value:
        text = value
    else:
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template: cannot read {value!r}: {exc.strerror}") from exc
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not parse: {exc}") from exc
    return text
