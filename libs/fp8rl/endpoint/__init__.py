"""The OpenAI-compatible, token-carrying HTTP endpoint of a rollout engine (issue 51): :mod:`.chat` (requests →
prompt ids, token in / token out), :mod:`.choices` (samples → OpenAI choices and stream chunks), :mod:`.sessions`
(one recorded trajectory per session), :mod:`.server` (the aiohttp application, batching, bounds)."""

from .chat import TOKEN_FIELDS, CompletionRequest, EndpointError, EndpointLimits
from .server import EndpointConfig, OpenAIEndpoint
from .sessions import SESSION_HEADER, SessionBook

__all__ = ["SESSION_HEADER", "TOKEN_FIELDS", "CompletionRequest", "EndpointConfig", "EndpointError",
           "EndpointLimits", "OpenAIEndpoint", "SessionBook"]
