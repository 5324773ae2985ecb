"""gateway/: the OpenAI-compatible HTTP server (auth, validation, worker calls, metrics, admin).

No model hub at run time and litellm's bundled price map only: set before litellm is imported.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from gateway.app import create_app  # noqa: E402
from gateway.settings import Settings  # noqa: E402

__all__ = ["Settings", "create_app"]
