"""Chat templates: a conversation (OpenAI's ``messages``) as the prompt text the
target model was trained on.

The template is the target tokenizer's own (its ``chat_template``, rendered by
transformers' ``apply_chat_template`` as every serving engine renders it; of a
tokenizer with named templates, its ``default``), or the file given with
``--chat-template``, which takes its place. A tokenizer without one, and no
file, cannot take chat requests: they are refused saying how to give one. The
prompt ends with the generation prompt (the assistant's header) where the
template has one.

Messages are ``system``, ``user`` or ``assistant`` (``developer`` is read as
``system``); their content is a string, or a list of text parts, joined with
newlines (a template sees a string either way). Any other role, content or
part type is refused (:class:`MessageError`, naming the message's field).
The template's own refusal (its ``raise_exception()``, a Jinja error) is the
request's fault too; any other failure of the renderer is the server's.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

from specdec.core.text import excerpt
from specdec.serving import errors

try:
    from jinja2 import TemplateError
except ImportError:  # (transformers renders templates with jinja2: without it there is nothing to render)
    TemplateError = ValueError

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}
NO_TEMPLATE = ("the model's tokenizer has no chat template{}, so chat requests cannot be rendered: start the "
               "coordinator with --chat-template FILE (a Jinja template, as in a tokenizer_config.json's "
               "chat_template), or use /v1/completions")


class MessageError(errors.InvalidRequest):
    """A message the chat cannot take; ``param`` names its field (``messages[2].content``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ChatTemplate:
    """Renders conversations with ``--chat-template``'s file (``path``), or else
    with the tokenizer's own template."""

    def __init__(self, path: str | pathlib.Path | None = None):
        self.source = str(path) if path else ""
        self.template = pathlib.Path(path).read_text(encoding="utf-8") if path else None

    def render(self, tokenizer, messages: Sequence[Mapping]) -> str:
        """The prompt for ``messages`` (checked here) with ``tokenizer``'s
        template, or this file's; InvalidRequest when there is none, or the
        template refuses them."""
        conversation = [plain_message(message, i) for i, message in enumerate(messages)]
        if not conversation:
            raise errors.InvalidRequest("messages is empty: give at least one message")
        if tokenizer is None:
            raise errors.InvalidRequest("this coordinator has no tokenizer (--tokenizer none), so it cannot render "
                                        "a chat: use /v1/completions with prompt token ids")
        if self.template is None:
            own = getattr(tokenizer, "chat_template", None)
            if not own:
                raise errors.InvalidRequest(NO_TEMPLATE.format(""))
            if isinstance(own, Mapping) and not own.get("default"):  # named templates, none the default
                raise errors.InvalidRequest(NO_TEMPLATE.format(f" named 'default' (it has {', '.join(sorted(own))})"))
        try:  # chat_template None: the tokenizer's own (of named ones, its default)
            return tokenizer.apply_chat_template(conversation, chat_template=self.template,
                                                 add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError) as e:  # the template's own refusal (raise_exception()): the request's
            where = f"--chat-template {self.source}" if self.template else "the tokenizer's chat template"
            raise errors.InvalidRequest(f"{where} could not render these messages: {e}") from None


def plain_message(message: Mapping, index: int) -> dict[str, str]:
    """``{"role", "content"}`` with the content as one string; MessageError
    naming ``messages[index]``'s field for what is not supported."""
    role = message.get("role")
    if not isinstance(role, str):
        raise MessageError(f"messages[{index}].role is required" if role is None else
                           f"messages[{index}].role must be a string, not {type(role).__name__}",
                           f"messages[{index}].role")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise MessageError(f"messages[{index}].role {excerpt(role)} is not supported: use one of "
                           f"{', '.join(ROLES)}", f"messages[{index}].role")
    return {"role": role, "content": message_text(message.get("content"), index)}


def message_text(content, index: int) -> str:
    """A message's content as one string: a string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"messages[{index}].content must be a string or a list of text parts, not "
                           f"{type(content).__name__}", f"messages[{index}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise MessageError(f"messages[{index}].content[{j}] is of type {excerpt(kind)}: only text parts "
                               "({\"type\": \"text\", \"text\": ...}) are supported", f"messages[{index}].content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)
