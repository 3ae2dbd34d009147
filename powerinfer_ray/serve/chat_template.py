"""Chat messages -> prompt text with the model's own chat template."""
from __future__ import annotations

import json
import logging

from .errors import bad_request

log = logging.getLogger(__name__)


class ChatTemplate:
    """Messages -> prompt text: the GGUF ``tokenizer.chat_template`` rendered with jinja2 (as HF
    renders it) when the model has one and jinja2 is installed, else plain "role: content" lines."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "", add_bos: bool = True) -> None:
        self.bos_token, self.eos_token, self.add_bos = bos_token or "", eos_token or "", add_bos
        self.jinja = _compile(template) if template else None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.jinja is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        try:
            text = self.jinja.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as exc:  # noqa: BLE001  (template errors are the request's: raise_exception, bad roles)
            raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from exc
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]  # the engine's tokenizer adds BOS itself
        return text


def _compile(template: str):  # noqa: ANN202  (jinja2.Template | None)
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed: chat prompts use the plain 'role: content' template")
        return None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters.setdefault("tojson", lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent))
    try:
        return env.from_string(template)
    except TemplateError as exc:
        log.warning("the model's chat template does not compile (%s): using the plain template", exc)
        return None
