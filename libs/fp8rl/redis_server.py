"""A private ``redis-server`` on this machine: the password, its files and the URL that carries it.

Every path that starts a Redis for fp8rl (``deploy.launcher``, the benches' throwaway servers) goes through
:class:`RedisSecret`, so that no local process without the password can read or write the coordination keys
(``weights:latest``, the manifests that name the WeightStore endpoint and the shard checksums, leases, acks,
job state, the events stream). Compose and the Helm chart set their own password (``$FP8RL_REDIS_PASSWORD``,
the chart's Secret).

Invariants:

* The password never appears on a command line or in the environment: ``redis-server`` reads it from
  ``redis.conf`` (``requirepass``), given as its first argument, and services read the URL that carries it
  from ``redis.url`` (``--redis-url-file``). Both files are created mode 0600 in a 0700 directory — never
  readable by another user, not even for an instant.
* The command (:meth:`RedisSecret.command`) holds the config file's path, not the password: a process restarted
  from the same command line (``stack.json``'s ``cmd``) requires the same password, and the URL file stays valid
  while the port is the same.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PASSWORD_BYTES", "RedisSecret", "write_private_file"]

PASSWORD_BYTES = 32  # 256 bits from the OS CSPRNG, hex-encoded: nothing in it needs escaping in a URL or config


def write_private_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, created mode 0600 (a previous file there is replaced); its directory is made 0700.

    The file is created with ``O_EXCL`` and its final mode, so no other user can open it between creation and a
    later ``chmod``.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclass(frozen=True)
class RedisSecret:
    """One server's password and the two private files that hold it.

    Attributes:
        password: the ``requirepass`` of the server (hex).
        config_file: ``redis.conf`` with the ``requirepass`` line (0600); the server's first argument.
        url_file: ``redis.url``, ``redis://:PASSWORD@127.0.0.1:PORT/0`` once :meth:`write_url` ran (0600);
            what services get as ``--redis-url-file``.
    """

    password: str
    config_file: Path
    url_file: Path

    @classmethod
    def create(cls, directory: str | Path) -> RedisSecret:
        """A fresh random password written to ``directory/redis.conf`` (``directory`` 0700, the file 0600)."""
        directory = Path(directory)
        password = secrets.token_hex(PASSWORD_BYTES)
        config = write_private_file(directory / "redis.conf", f"requirepass {password}\n")
        return cls(password, config, directory / "redis.url")

    def command(self, exe: str, port: int, data_dir: str | Path, *options: str) -> list[str]:
        """``redis-server`` on ``127.0.0.1:port`` with ``data_dir`` as its ``--dir``, requiring the password (read
        from :attr:`config_file`, so it is not on the command line); ``options`` are more ``--name value`` pairs."""
        return [exe, str(self.config_file), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
                *options]

    def url(self, port: int, host: str = "127.0.0.1", db: int = 0) -> str:
        """The URL a client connects with: it carries the password, so print it only through ``redact_url``."""
        return f"redis://:{self.password}@{host}:{port}/{db}"

    def write_url(self, port: int) -> str:
        """Write :meth:`url` for ``port`` to :attr:`url_file` (0600); returns the URL."""
        url = self.url(port)
        write_private_file(self.url_file, url + "\n")
        return url
