"""Every service's security flags: the two bearer-token scopes, TLS, and the refusal to listen openly.

Flags (each falls back to an environment variable when absent; see :data:`SECURITY_ENV`):

==========================================  ============================  =========================================
flag                                        environment                   meaning
==========================================  ============================  =========================================
``--service-token`` / ``--service-token-    ``FP8RL_SERVICE_TOKEN`` /     token of the internal RPCs (TrainStep,
file``                                      ``FP8RL_SERVICE_TOKEN_FILE``  Generate, Score, Calibrate, the WeightStore,
                                                                          Status ...); this service also sends it on
                                                                          its own calls to the other services
``--client-token`` (alias ``--token``) /    ``FP8RL_CLIENT_TOKEN``,       token of the controller's JobService (what
``--client-token-file``                     else ``FP8RL_AUTH_TOKEN`` /   the SDK / CLI sends); other services know it
                                            ``FP8RL_CLIENT_TOKEN_FILE``   only to answer its holder PERMISSION_DENIED
``--insecure``                              ``FP8RL_INSECURE=1``          allow listening off loopback without tokens
``--tls-cert`` / ``--tls-key``              ``FP8RL_TLS_CERT`` / ``_KEY`` serve TLS only
``--tls-ca``                                ``FP8RL_TLS_CA``              CA this service's outgoing calls verify
==========================================  ============================  =========================================

Per scope the first source found wins, in the order: token flag, file flag, token variable(s), file
variable. A token file holds the token alone (a trailing newline is fine), so secrets need not sit on a
command line or in the environment: ``deploy.launcher`` writes ``RUN/secrets/{service,client}.token``
(mode 0600) and passes only their paths.

Secure by default: a service refuses to start (exit 2) when it would listen on an address that is not
loopback while a scope it serves has no token — unless ``--insecure`` says that is intended. The two
tokens must differ (equal tokens would let a client-token holder call the internal RPCs).

Errors are :class:`ValueError` with the flag and the fix named; the skeleton turns them into
:class:`~services.common.runtime.StartupError`.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from collections.abc import Iterable

from fp8rl.rpc.channel import ENV_AUTH_TOKEN, ENV_TLS_CA, ENV_TOKEN_FILE, read_token_file, set_process_token
from fp8rl.rpc.server import SCOPE_CLIENT, SCOPE_SERVICE, ScopedTokens

log = logging.getLogger("fp8rl.service")

__all__ = ["SECRET_ENV", "SECURITY_ENV", "add_security_args", "apply_security_args", "is_loopback_host",
           "resolve_tokens"]

SECURITY_ENV = {
    "service_token": "FP8RL_SERVICE_TOKEN", "service_token_file": "FP8RL_SERVICE_TOKEN_FILE",
    "client_token": "FP8RL_CLIENT_TOKEN", "client_token_file": "FP8RL_CLIENT_TOKEN_FILE",
    "insecure": "FP8RL_INSECURE", "tls_cert": "FP8RL_TLS_CERT", "tls_key": "FP8RL_TLS_KEY", "tls_ca": "FP8RL_TLS_CA",
}
_TRUE = {"1", "true", "yes", "on"}

SECRET_ENV = ("FP8RL_SERVICE_TOKEN", "FP8RL_SERVICE_TOKEN_FILE", "FP8RL_CLIENT_TOKEN", "FP8RL_CLIENT_TOKEN_FILE",
              ENV_AUTH_TOKEN, ENV_TOKEN_FILE)
"""Environment variables that hold a token or name its file: removed once read (:func:`apply_security_args`)."""


def add_security_args(p: argparse.ArgumentParser) -> None:
    """Adds the flags of the module docstring to ``p`` (token defaults are resolved by :func:`resolve_tokens`)."""
    p.add_argument("--service-token", default=None,
                   help=f"token of the internal RPCs; this service also sends it on its own calls "
                        f"(default ${SECURITY_ENV['service_token']})")
    p.add_argument("--service-token-file", default=None,
                   help=f"file holding the service token (default ${SECURITY_ENV['service_token_file']})")
    p.add_argument("--client-token", "--token", dest="client_token", default=None,
                   help=f"token of the controller's JobService, what the SDK/CLI sends (default "
                        f"${SECURITY_ENV['client_token']}, else ${ENV_AUTH_TOKEN}); --token is the old name")
    p.add_argument("--client-token-file", default=None,
                   help=f"file holding the client token (default ${SECURITY_ENV['client_token_file']})")
    p.add_argument("--insecure", action="store_true",
                   default=os.environ.get(SECURITY_ENV["insecure"], "").strip().lower() in _TRUE,
                   help="listen on a non-loopback address even when a scope this service serves has no token")
    p.add_argument("--tls-cert", default=os.environ.get(SECURITY_ENV["tls_cert"]),
                   help="PEM certificate chain: serve TLS only")
    p.add_argument("--tls-key", default=os.environ.get(SECURITY_ENV["tls_key"]), help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=os.environ.get(SECURITY_ENV["tls_ca"]),
                   help="PEM CA that this service's outgoing calls verify other services against")


def _resolve_one(args: argparse.Namespace, scope: str, env_tokens: tuple[str, ...]) -> str | None:
    flag, file_flag = getattr(args, f"{scope}_token"), getattr(args, f"{scope}_token_file")
    if flag is not None and file_flag is not None:
        raise ValueError(f"--{scope}-token and --{scope}-token-file both given: give the {scope} token one way")
    if flag is not None:
        return flag or None
    if file_flag is not None:
        return read_token_file(file_flag, f"--{scope}-token-file")
    for var in env_tokens:
        if os.environ.get(var):
            return os.environ[var]
    env_file = SECURITY_ENV[f"{scope}_token_file"]
    if os.environ.get(env_file):
        return read_token_file(os.environ[env_file], f"${env_file}")
    return None


def resolve_tokens(args: argparse.Namespace) -> ScopedTokens:
    """The service and client tokens from the flags and the environment (module docstring order).

    Raises:
        ValueError: both a token and a token file for one scope, an unusable token file, or equal tokens.
        FileNotFoundError: a token file does not exist.
    """
    tokens = ScopedTokens(service=_resolve_one(args, SCOPE_SERVICE, (SECURITY_ENV["service_token"],)),
                          client=_resolve_one(args, SCOPE_CLIENT, (SECURITY_ENV["client_token"], ENV_AUTH_TOKEN)))
    if tokens.service is not None and tokens.service == tokens.client:
        raise ValueError("the service token and the client token are equal: give each scope its own token "
                         "(a client-token holder could otherwise call the internal RPCs)")
    return tokens


def is_loopback_host(host: str) -> bool:
    """True when binding ``host`` only accepts connections from this machine (``127.0.0.0/8``, ``::1``, localhost).

    Wildcards (``[::]``, ``0.0.0.0``, ``""``) and host names other than ``localhost`` are not loopback.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def apply_security_args(args: argparse.Namespace, scopes: Iterable[str] = (SCOPE_SERVICE,)) -> ScopedTokens:
    """Resolves the tokens, refuses an open listener, and makes the service token this process's outgoing one.

    Sets ``args.tokens`` to the resolved :class:`~fp8rl.rpc.server.ScopedTokens`. Outgoing channels made by
    :func:`fp8rl.rpc.channel.make_channel` send the service token (:func:`~fp8rl.rpc.channel.set_process_token`:
    held in memory; a service never sends the client token) and verify against ``--tls-ca`` (exported as
    ``$FP8RL_TLS_CA``, not a secret). Every token variable (:data:`SECRET_ENV`) is then removed from this
    process's environment, so what it starts — the reward service's grading workers, which parse untrusted
    model output; vLLM's engine processes — holds no token.

    Args:
        args: parsed flags of :func:`add_security_args` plus ``--host``.
        scopes: the scopes this server serves (the controller: client; every other role: service).

    Raises:
        ValueError: see :func:`resolve_tokens`; TLS half-configured; or ``args.host`` is not loopback, a scope in
            ``scopes`` has no token and ``--insecure`` was not given (the message names the fixes).
    """
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: give both (TLS) or neither (plaintext)")
    tokens = resolve_tokens(args)
    open_scopes = [s for s in scopes if tokens.get(s) is None]
    host = getattr(args, "host", "[::]")
    if open_scopes and not is_loopback_host(host):
        if not args.insecure:
            s = open_scopes[0]
            raise ValueError(
                f"refusing to listen on {host!r} (not a loopback address) without the {s} token: anyone who can "
                f"reach the port could call its RPCs. Give --{s}-token-file FILE (or ${SECURITY_ENV[f'{s}_token']}), "
                f"listen on --host 127.0.0.1, or pass --insecure (${SECURITY_ENV['insecure']}=1) to serve it "
                f"unauthenticated on purpose")
        log.warning("--insecure: listening on %s with no %s token; those RPCs accept any caller", host,
                    " or ".join(open_scopes))
    elif open_scopes:
        log.warning("no %s token: its RPCs accept any local caller on %s", " or ".join(open_scopes), host)
    set_process_token(tokens.service)  # sent on this service's own calls; never the client token
    for var in SECRET_ENV:  # read once, above: the processes this service starts (grading workers) inherit nothing
        os.environ.pop(var, None)
    if args.tls_ca is not None:
        os.environ[ENV_TLS_CA] = args.tls_ca
    args.tokens = tokens
    return tokens
