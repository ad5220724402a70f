"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them,
with jinja2 alone: the sandboxed environment with trim_blocks / lstrip_blocks and loop controls,
its `tojson` filter (no HTML escaping), `raise_exception`, `strftime_now`, a restricted `dict`
and a `namespace` refusing underscore names; messages' None values dropped, reasoning fields
aliased, the special tokens' strings as variables, and continue_final_message's cut.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional

# A message's reasoning, under the names templates read (the first is the standard one).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the message to continue, to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (the assistant mask is not asked for here)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the class itself (no attribute escapes)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """What a template may see: JSON types rebuilt (subclasses stripped), anything else a "<Type>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat_template(
    template: str,
    conversation: list[dict[str, Any]],
    special_tokens: dict[str, str],
    tools: Optional[list[dict[str, Any]]] = None,
    documents: Optional[list[dict[str, Any]]] = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """The rendered text; special_tokens: the tokenizer's named special tokens (bos_token, ...),
    which kwargs override. Errors are jinja2's (a template's raise_exception: TemplateError)."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError(f"tools must be JSON schema dicts, got {type(tool).__name__}.")
    chat = []
    for message in conversation:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        chat.append(_with_reasoning_aliases(_plain({k: v for k, v in message.items() if v is not None})))
    final_text: Optional[str] = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = chat[-1].get(field)
        if final_text is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final_text]
        if not any(name in template for name in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
        if isinstance(final_text, (list, tuple)):
            for block in reversed(final_text):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
        else:
            for name in fields:
                chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    variables = _plain({**special_tokens, **kwargs})
    rendered = _compiled(template).render(
        messages=chat, tools=_plain(tools), documents=_plain(documents), add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if final_text is None:
        return rendered
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template.")
    at = rendered.rindex(tag)
    # a template that keeps the message's spacing keeps the tag's trailing space too
    return rendered[:at] if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
