"""llama-cpp-python's server with a catalog `local.chat_template` (policies/chat_template.py).

    python -m gateway.llama_server --polyroute_chat_template <name or path> <llama_cpp.server args>

llama-cpp-python can take a chat template only from the GGUF, a built-in `chat_format` or a
tokenizer_config.json, and none of these carries stop sequences. So the gateway (local_worker.py)
starts the server through this module, which registers the template, with its stop sequences, as
the chat format the server then uses; the rest is llama_cpp.server as it is. Stop sequences are
removed from the answer by llama.cpp (streamed or not), and a request's own `stop` adds to them.
"""

from __future__ import annotations

import sys
from typing import Any

from policies.chat_template import ChatTemplate, load_chat_template

FORMAT_NAME = "polyroute-template"
OPTION = "--polyroute_chat_template"


def chat_handler(template: ChatTemplate) -> Any:
    """A llama-cpp-python chat completion handler rendering prompts with `template`."""
    from llama_cpp import llama_chat_format

    def handler(*, llama: Any, **kwargs: Any) -> Any:
        bos = llama._model.token_get_text(llama.token_bos()) if llama.token_bos() != -1 else ""
        eos = llama._model.token_get_text(llama.token_eos()) if llama.token_eos() != -1 else ""

        def formatter(*, messages: list[dict[str, Any]], **extra: Any) -> Any:
            return llama_chat_format.ChatFormatterResponse(
                prompt=template.render(messages, bos_token=bos, eos_token=eos),
                stop=template.stops(eos),
                added_special=True,  # the template writes the BOS itself, as HF templates do
            )

        return llama_chat_format.chat_formatter_to_chat_completion_handler(formatter)(llama=llama, **kwargs)

    return handler


def main(argv: list[str]) -> None:
    if OPTION not in argv[:-1]:
        raise SystemExit(f"usage: python -m gateway.llama_server {OPTION} <template> <llama_cpp.server args>")
    at = argv.index(OPTION)
    template = load_chat_template(argv[at + 1])
    rest = argv[:at] + argv[at + 2 :]
    if "--chat_format" in rest:
        raise SystemExit(f"{OPTION} replaces --chat_format; give one of them")

    from llama_cpp import llama_chat_format
    from llama_cpp.server.__main__ import main as serve

    llama_chat_format.LlamaChatCompletionHandlerRegistry().register_chat_completion_handler(
        FORMAT_NAME, chat_handler(template), overwrite=True
    )
    print(
        f"polyroute: chat template {template.source}, stop {template.stops()!r}", file=sys.stderr, flush=True
    )
    sys.argv = [sys.argv[0], *rest, "--chat_format", FORMAT_NAME]
    serve()


if __name__ == "__main__":
    main(sys.argv[1:])
