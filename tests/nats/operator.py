"""A NATS server in operator mode (decentralized JWT authentication) for the tests:
an operator, a system account, an application account with JetStream, and user
credentials files (`.creds`: a user JWT and its nkey seed), signed here with `nkeys` as
`nsc` would sign them, for a memory resolver preloaded with the accounts."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import nkeys

__all__ = ["Operator"]

_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
              "wildcards": True, "conn": -1, "leaf": -1}
_JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def _pair(prefix: int) -> tuple[str, Any]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed.decode(), nkeys.from_seed(seed)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(nats: dict[str, Any], subject: str, name: str, issuer: Any) -> str:
    """A NATS JWT (v2) for `subject`, signed by the `issuer` key pair."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public_key.decode(),
                              "name": name, "sub": subject, "nats": nats}
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(issuer.sign(f'{header}.{body}'.encode()))}"


class Operator:
    """An operator with one JetStream account; `config()` is the server's
    configuration, `creds(...)` writes a user's credentials file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        _, self._operator = _pair(nkeys.PREFIX_BYTE_OPERATOR)
        _, self._system = _pair(nkeys.PREFIX_BYTE_ACCOUNT)
        _, self.account = _pair(nkeys.PREFIX_BYTE_ACCOUNT)

    def config(self) -> Path:
        """The server's configuration file (memory resolver, accounts preloaded)."""
        system = self._system.public_key.decode()
        account = self.account.public_key.decode()
        operator = _jwt({"type": "operator", "version": 2, "system_account": system},
                        self._operator.public_key.decode(), "turnrouter-test", self._operator)
        accounts = {
            system: _jwt({"type": "account", "version": 2, "limits": _UNLIMITED}, system,
                         "SYS", self._operator),
            account: _jwt({"type": "account", "version": 2,
                           "limits": {**_UNLIMITED, **_JETSTREAM}}, account, "APP",
                          self._operator)}
        path = self.folder / "operator.conf"
        path.write_text(f"operator: {operator}\nsystem_account: {system}\nresolver: MEMORY\n"
                        "resolver_preload: {\n"
                        + "".join(f"  {key}: {jwt}\n" for key, jwt in accounts.items())
                        + "}\n")
        return path

    def creds(self, name: str, *, signer: Any = None,
              publish: list[str] | None = None) -> tuple[Path, str]:
        """A user's `.creds` file and its seed; `signer`: another account's key pair
        (a user the server does not trust); `publish`: the subjects it may publish to."""
        seed, user = _pair(nkeys.PREFIX_BYTE_USER)
        issuer = signer or self.account
        permissions = {"pub": {} if publish is None else {"allow": publish}, "sub": {}}
        token = _jwt({"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                      **permissions}, user.public_key.decode(), name, issuer)
        path = self.folder / f"{name}.creds"
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")
        return path, seed

    @staticmethod
    def stranger() -> Any:
        """An account key pair the operator never signed."""
        return _pair(nkeys.PREFIX_BYTE_ACCOUNT)[1]
