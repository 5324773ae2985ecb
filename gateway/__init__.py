"""gateway/: the OpenAI-compatible HTTP server (auth, validation, worker calls, metrics, admin).

No model hub at run time and litellm's bundled price map only: set before litellm is imported.
The public names load lazily, so light users (the CLI's key commands) don't import litellm.
"""

import os
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

if TYPE_CHECKING:
    from gateway.app import create_app
    from gateway.settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from gateway.app import create_app

        return create_app
    if name == "Settings":
        from gateway.settings import Settings

        return Settings
    raise AttributeError(name)
