"""Chat templates for local workers: a Jinja prompt template plus stop sequences, from a file.

A local worker's `local.chat_template` names a template shipped with polyroute (a file
policies/defaults/chat-template.<name>.yaml, e.g. `base-qa`) or a path to a file of one's own: YAML or JSON
with the keys of a Hugging Face tokenizer_config.json (`chat_template`, `bos_token`, `eos_token`),
so an instruct model's tokenizer_config.json works as it is, plus polyroute's own:

  stop         extra stop sequences; the model stops there and they are not part of the answer
  system_role  false when the template has no place for system messages (the gateway then folds
               them into the user turn, see Worker.folds_system)
  description  one line for humans

The gateway's llama.cpp launcher (gateway/llama_server.py) renders prompts with `render` below, the
same Jinja environment llama-cpp-python uses for chat templates, so what the tests render is what
the model sees. Loading validates everything (Jinja syntax included) so a bad catalog is refused.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from policies.yamlfile import load_yaml

# Next to workers.yaml, so the package data that ships it (defaults/*.yaml) ships them too.
BUILTIN_DIR = Path(__file__).parent / "defaults"
BUILTIN_PREFIX = "chat-template."
SUFFIXES = (".yaml", ".yml", ".json")


class ChatTemplateError(ValueError):
    """The template file is missing or invalid; the message says which and why."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    template: str
    bos_token: str | None = None  # None: the model's own (from the GGUF)
    eos_token: str | None = None
    stop: tuple[str, ...] = ()
    system_role: bool | None = None
    description: str = ""

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        bos_token: str = "",
        eos_token: str = "",
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`; bos/eos from the file win over the ones passed (the model's)."""

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"{self.source}: {message}")

        return _compile(self.template).render(
            messages=messages,
            bos_token=self.bos_token if self.bos_token is not None else bos_token,
            eos_token=self.eos_token if self.eos_token is not None else eos_token,
            add_generation_prompt=add_generation_prompt,
            raise_exception=raise_exception,
            **extra,
        )

    def stops(self, eos_token: str = "") -> list[str]:
        """Stop sequences for a completion: the end-of-sequence text and the template's own."""
        eos = self.eos_token if self.eos_token is not None else eos_token
        return [s for s in (eos, *self.stop) if s]


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    # What llama-cpp-python's Jinja2ChatFormatter builds (llama_chat_format.py), minus its
    # {% generation %} pass-through, which a prompt template has no use for.
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def builtin_names() -> list[str]:
    return sorted(p.stem[len(BUILTIN_PREFIX) :] for p in BUILTIN_DIR.glob(f"{BUILTIN_PREFIX}*.yaml"))


def resolve_path(spec: str) -> Path:
    """A built-in template's file, or the file a path names (checked to exist)."""
    if "/" not in spec and "\\" not in spec and not spec.endswith(SUFFIXES):
        path = BUILTIN_DIR / f"{BUILTIN_PREFIX}{spec}.yaml"
        if path.is_file():
            return path
        raise ChatTemplateError(
            f"unknown built-in chat template {spec!r} (built-in: {', '.join(builtin_names())}; "
            "or give a path to a .yaml/.json file)"
        )
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ChatTemplateError(f"chat template file not found: {path}")
    return path


def _token(data: dict[str, Any], key: str, source: str) -> str | None:
    value = data.get(key)
    if isinstance(value, dict):  # tokenizer_config.json's AddedToken form: {"content": "<s>", ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{source}: {key} must be a string")
    return value


def load_chat_template(spec: str) -> ChatTemplate:
    """Load and validate a template named by a catalog's `local.chat_template`."""
    path = resolve_path(spec)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else load_yaml(text)  # repeated keys refused
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ChatTemplateError(f"{source}: cannot read chat template: {exc}") from exc
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{source}: expected a mapping with a 'chat_template' key")
    template = data.get("chat_template")
    if isinstance(template, list):  # tokenizer_config.json may list named templates; take 'default'
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError(f"{source}: 'chat_template' must be a non-empty Jinja string")
    try:
        _compile(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError and friends
        raise ChatTemplateError(f"{source}: chat_template is not valid Jinja: {exc}") from exc
    stop = data.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ChatTemplateError(f"{source}: 'stop' must be a list of non-empty strings")
    system_role = data.get("system_role")
    if system_role is not None and not isinstance(system_role, bool):
        raise ChatTemplateError(f"{source}: 'system_role' must be true or false")
    return ChatTemplate(
        source=source,
        template=template,
        bos_token=_token(data, "bos_token", source),
        eos_token=_token(data, "eos_token", source),
        stop=tuple(stop),
        system_role=system_role,
        description=str(data.get("description") or ""),
    )
