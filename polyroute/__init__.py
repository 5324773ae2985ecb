"""polyroute: the Python SDK (`Client`, `AsyncClient`) and the `polyroute` command.

The SDK imports none of the server packages; it only speaks HTTP to a gateway.
"""

from polyroute.client import (
    AsyncClient,
    ChatResult,
    ChatStream,
    Client,
    PolyrouteConnectionError,
    PolyrouteError,
    PolyrouteTimeout,
    Route,
)

__all__ = [
    "AsyncClient",
    "ChatResult",
    "ChatStream",
    "Client",
    "PolyrouteConnectionError",
    "PolyrouteError",
    "PolyrouteTimeout",
    "Route",
]
__version__ = "0.1.0"
