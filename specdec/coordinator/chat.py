"""Chat templates: a conversation (OpenAI's ``messages``) as the prompt text the
target model was trained on.

The template is the target tokenizer's own (its ``chat_template``, rendered by
transformers' ``apply_chat_template`` as every serving engine renders it), or
the file given with ``--chat-template``, which takes its place. A tokenizer
without one, and no file, cannot take chat requests: they are refused saying
how to give one. The prompt ends with the generation prompt (the assistant's
header) where the template has one.

Messages are ``system``, ``user`` or ``assistant`` (``developer`` is read as
``system``); their content is a string, or a list of text parts, joined with
newlines (a template sees a string either way). Any other role or part type is
refused, naming the message.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

from specdec.serving import errors

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}


class ChatTemplate:
    """Renders conversations with ``--chat-template``'s file (``path``), or else
    with the tokenizer's own template."""

    def __init__(self, path: str | pathlib.Path | None = None):
        self.source = str(path) if path else ""
        self.template = pathlib.Path(path).read_text(encoding="utf-8") if path else None

    def render(self, tokenizer, messages: Sequence[Mapping]) -> str:
        """The prompt for ``messages`` (checked here) with ``tokenizer``'s
        template, or this file's; InvalidRequest when there is none."""
        conversation = [plain_message(message, i) for i, message in enumerate(messages)]
        if not conversation:
            raise errors.InvalidRequest("messages is empty: give at least one message")
        if tokenizer is None:
            raise errors.InvalidRequest("this coordinator has no tokenizer (--tokenizer none), so it cannot render "
                                        "a chat: use /v1/completions with prompt token ids")
        template = self.template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise errors.InvalidRequest(
                "the model's tokenizer has no chat template, so chat requests cannot be rendered: start the "
                "coordinator with --chat-template FILE (a Jinja template, as in a tokenizer_config.json's "
                "chat_template), or use /v1/completions")
        try:
            return tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:  # the template's own error (raise_exception(), a Jinja error): the request's fault
            where = f"--chat-template {self.source}" if self.template else "the tokenizer's chat template"
            raise errors.InvalidRequest(f"{where} could not render these messages: {e}") from None


def plain_message(message: Mapping, index: int) -> dict[str, str]:
    """``{"role", "content"}`` with the content as one string; InvalidRequest
    naming ``messages[index]`` for what is not supported."""
    role = message.get("role")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise errors.InvalidRequest(f"messages[{index}].role {_shown(role)} is not supported: use one of "
                                    f"{', '.join(ROLES)}")
    return {"role": role, "content": message_text(message.get("content"), index)}


def message_text(content, index: int) -> str:
    """A message's content as one string: a string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise errors.InvalidRequest(f"messages[{index}].content[{j}] is of type {_shown(kind)}: only text "
                                        "parts ({\"type\": \"text\", \"text\": ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _shown(value) -> str:
    """A client's value in an error message, bounded."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
