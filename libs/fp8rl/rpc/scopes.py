"""The two bearer-token scopes of the fp8rl wire, and the check a server runs on a call's metadata.

* **client** — the controller's ``JobService`` (submit, watch, get, list, cancel): what an SDK / CLI
  user holds;
* **service** — every other RPC (TrainStep, ComputeLogprobs, SaveCheckpoint, the WeightStore,
  Generate, Score, Calibrate, each service's Status): what the services send one another.

A call must carry ``authorization: Bearer <token>`` of its RPC's scope. No token, or one that is
neither scope's, fails with UNAUTHENTICATED; the *other* scope's token fails with PERMISSION_DENIED
naming the scope needed (so a client-token holder can neither train nor read weights). A scope with
no token configured is open. The health service is always open: kubelet's native gRPC probes cannot
send metadata, and health reveals nothing but SERVING / NOT_SERVING. What a caller without a token may
do there is narrow (:meth:`TokenCheck.health_open`): ``Check`` is answered with the server's overall status
without its request message being read (so it can neither be held open nor make the server buffer a byte
beyond the HTTP/2 stream window), and ``Watch`` — a stream that stays open — needs a token. Reflection is
*not* exempt (it reveals the API surface): either scope's token opens it.

:class:`TokenCheck` decides from the call's metadata alone, so a server can refuse a call before it
reads (or waits for) a single byte of its request (:mod:`fp8rl.rpc.guard`).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from .channel import ENV_AUTH_TOKEN, ENV_TOKEN_FILE

__all__ = ["CLIENT_SCOPE_SERVICES", "HEALTH_CHECK", "HEALTH_SERVICE", "REFLECTION_SERVICE", "SCOPE_CLIENT",
           "SCOPE_SERVICE", "ScopedTokens", "TokenCheck", "rpc_scope"]

HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_CHECK = f"/{HEALTH_SERVICE}/Check"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"

SCOPE_CLIENT, SCOPE_SERVICE = "client", "service"
# The services an SDK / CLI user may call (client scope); every other fp8rl service is internal (service scope).
CLIENT_SCOPE_SERVICES = frozenset({"fp8rl.v1.JobService"})
_SCOPE_CALLS = {SCOPE_CLIENT: "JobService: submit, watch, get, list and cancel jobs",
                SCOPE_SERVICE: "the services' internal RPCs"}


def rpc_scope(method: str) -> str | None:
    """The scope whose token ``method`` (``/package.Service/Method``) needs.

    Returns :data:`SCOPE_CLIENT` for :data:`CLIENT_SCOPE_SERVICES`, None for health (open) and
    reflection (either scope's token), :data:`SCOPE_SERVICE` for everything else.
    """
    service = method.lstrip("/").split("/", 1)[0]
    if service in (HEALTH_SERVICE, REFLECTION_SERVICE):
        return None
    return SCOPE_CLIENT if service in CLIENT_SCOPE_SERVICES else SCOPE_SERVICE


@dataclass(frozen=True)
class ScopedTokens:
    """The bearer token of each scope; None (or "") leaves that scope open.

    Attributes:
        service: token of the internal RPCs (every service but the controller's JobService).
        client: token of the JobService (what the SDK / CLI sends).
    """

    service: str | None = None
    client: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "service", self.service or None)
        object.__setattr__(self, "client", self.client or None)

    def get(self, scope: str) -> str | None:
        """The token of ``scope`` (:data:`SCOPE_SERVICE` or :data:`SCOPE_CLIENT`)."""
        return self.service if scope == SCOPE_SERVICE else self.client


class TokenCheck:
    """Checks a call's ``authorization: Bearer <token>`` against its RPC's scope (see the module docstring)."""

    def __init__(self, tokens: ScopedTokens):
        self._expected = {scope: f"Bearer {t}".encode() for scope in (SCOPE_SERVICE, SCOPE_CLIENT)
                          if (t := tokens.get(scope)) is not None}

    def refusal(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
                ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else the (code, message) to refuse it with.

        Health ``Check`` always proceeds (see :meth:`health_open` for how a caller without a token is served);
        health ``Watch`` needs either scope's token.
        """
        required = rpc_scope(method)
        service = method.lstrip("/").split("/", 1)[0]
        if not self._expected or method == HEALTH_CHECK or (required is not None and required not in self._expected):
            return None  # no auth at all, the open health Check, or a scope left open
        given = _bearer(metadata)
        held = self._held(given)
        if service == HEALTH_SERVICE:
            if held:
                return None
            return grpc.StatusCode.UNAUTHENTICATED, (
                f"{method} needs a token (it keeps a stream open); /{HEALTH_SERVICE}/Check is open to callers "
                f"without one")
        if held and (required is None or required in held):
            return None
        needed = f"the {required} token" if required else "a token"
        if held:
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{method} needs {needed} ({_SCOPE_CALLS[required]}); the {held[0]} token only grants "
                f"{_SCOPE_CALLS[held[0]]}")
        if given is None:
            return grpc.StatusCode.UNAUTHENTICATED, (
                f"missing bearer token for {method}: this server requires metadata 'authorization: Bearer "
                f"<token>' with {needed} (clients made by fp8rl.rpc.make_channel send ${ENV_AUTH_TOKEN} or the "
                f"file ${ENV_TOKEN_FILE})")
        return grpc.StatusCode.UNAUTHENTICATED, f"invalid bearer token for {method}: it is not {needed} of this server"

    def health_open(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether a health call is served *open* — answered without reading its request message.

        True for a caller holding neither scope's token on a server that has tokens: its ``Check`` is answered
        with the server's overall status (every service on a server shares it, :func:`fp8rl.rpc.server.set_serving`),
        and its request is never read. gRPC's receive limit is one number per server (the largest method's,
        256 MiB on the bulk services; a per-method service config is ignored on the server side), so reading
        a no-token message at all would let it be that large. A caller with a token, or any caller of a server
        without tokens, is served the standard way (its message read, an unknown service NOT_FOUND).
        """
        return bool(self._expected) and not self._held(_bearer(metadata))

    def _held(self, given: bytes | None) -> list[str]:
        """The scopes whose token the ``authorization`` value ``given`` is (constant-time compares, every scope
        checked)."""
        # every scope is compared (constant time each), so timing tells nothing about which one matched
        return [s for s, exp in self._expected.items() if given is not None and hmac.compare_digest(given, exp)]


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """The call's ``authorization`` metadata value as bytes (None when absent)."""
    given = next((v for k, v in metadata or () if k == "authorization"), None)
    return given.encode() if isinstance(given, str) else given
