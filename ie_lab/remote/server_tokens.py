"""`ie-lab serve`'s bearer tokens: who may call the server. Read from a file (re-read when its content changes) or
from the environment; every token compared in constant time. Apart from server.py so that what a token is, and how
a bad one is refused, reads as one room."""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import threading

from ..core.files import read_bytes
from ..errors import InputError

TOKENS_ENV = "IE_LAB_SERVE_TOKENS"  # "alice:TOKEN,bob:TOKEN", for a server started without a tokens file
MIN_TOKEN = 32  # characters: a shorter token is guessable, and refuses the file that holds it

MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class Tokens:
    """Bearer tokens, one per user: `NAME TOKEN` per line of the file (`#` starts a comment, blank lines are
    skipped), or TOKENS_ENV's `name:token,name:token`. A token has at least MIN_TOKEN visible ASCII characters and
    belongs to one user; a line that is not that refuses the whole file, naming the line (at start the server
    does not start; on a running server no token of the file is valid until it is fixed). The file is read again
    on every request and parsed again whenever its content changes (its hash: an edit that keeps the file's size
    and modification time still counts), so adding or revoking a user needs no restart. A token is compared in
    constant time against every known one."""

    def __init__(self, path: str | None, env: str | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._digest: bytes | None = None
        self._users: list[tuple[str, bytes]] = []
        self._env = self._parse_env(env) if env else []
        self._reload(strict=True)

    @staticmethod
    def _malformed(where: str, problem: str) -> InputError:
        return InputError(
            f"{where}: {problem}. Each line of a tokens file is 'NAME TOKEN': a name, a space, then a token of "
            f"{MIN_TOKEN} or more visible ASCII characters that no other line holds ('#' starts a comment); make a "
            f"token with: {MAKE_TOKEN}. Every token of the file is refused until the line is fixed."
        )

    @staticmethod
    def _token(where: str, name: str, tok: str) -> bytes:
        if len(tok) < MIN_TOKEN:
            raise Tokens._malformed(
                where, f"the token of {name!r} is {len(tok)} characters, shorter than {MIN_TOKEN} characters"
            )
        if not all(33 <= ord(c) <= 126 for c in tok):
            raise Tokens._malformed(where, f"the token of {name!r} holds a character other than visible ASCII")
        return tok.encode()

    @staticmethod
    def _parse(text: str, where: str) -> list[tuple[str, bytes]]:
        users: list[tuple[str, bytes]] = []
        seen: dict[bytes, int] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            at = f"{where} line {n}"
            parts = line.split()
            if len(parts) != 2:
                what = (
                    "one field, 'NAME:TOKEN' (the environment's form: the file takes a space between them)"
                    if len(parts) == 1 and ":" in parts[0]
                    else "one field alone (a name without a token, or a token without a name)"
                    if len(parts) == 1
                    else f"{len(parts)} fields"
                )
                raise Tokens._malformed(at, f"the line holds {what}, not 'NAME TOKEN'")
            name, tok = parts
            key = Tokens._token(at, name, tok)
            if key in seen:
                raise Tokens._malformed(at, f"the token of {name!r} is the one on line {seen[key]} too")
            seen[key] = n
            users.append((name, key))
        return users

    @staticmethod
    def _parse_env(env: str) -> list[tuple[str, bytes]]:
        users: list[tuple[str, bytes]] = []
        for i, item in enumerate((x.strip() for x in env.split(",")), 1):
            if not item:
                continue
            name, sep, tok = item.partition(":")
            at = f"${TOKENS_ENV} item {i}"
            if not sep or not name.strip() or not tok.strip() or len(item.split()) != 1:
                raise InputError(
                    f"{at} is not 'name:token' (it is not shown here: it may be a secret). {TOKENS_ENV} holds "
                    "'name:token,name:token' "
                    f"(tokens of {MIN_TOKEN}+ visible ASCII characters; make one with: {MAKE_TOKEN})."
                )
            if len(tok) < MIN_TOKEN or not all(33 <= ord(c) <= 126 for c in tok):
                raise InputError(
                    f"{at}: the token of {name!r} is not {MIN_TOKEN}+ visible ASCII characters. {TOKENS_ENV} "
                    f"holds 'name:token,name:token'; make a token with: {MAKE_TOKEN}."
                )
            users.append((name, tok.encode()))
        return users

    def _reload(self, strict: bool = False) -> None:
        """Read the file; parse it again if its content changed. strict (at start): refuse rather than log."""
        if self.path is None:
            self._users = self._env
            return
        if not os.path.lexists(self.path):
            if strict:
                raise InputError(f"no tokens file at {self.path}: write 'NAME TOKEN' lines there.") from None
            self._digest, self._users = None, self._env  # the file is gone: its users are revoked
            return
        try:
            data = read_bytes(self.path, "the tokens file", "text")  # a FIFO or a huge file is refused, never read
        except (OSError, InputError) as e:
            if strict:
                raise InputError(f"cannot read the tokens file {self.path}: {e}") from None
            if self._digest != b"unreadable":
                print(
                    f"ie-lab serve: cannot read {self.path}: {e}; no file token is valid until it can be read.",
                    file=sys.stderr,
                    flush=True,
                )
            self._digest, self._users = b"unreadable", self._env
            return
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return
        self._digest = digest
        try:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{self.path} is not UTF-8 text ({e}).") from None
            users = self._parse(text, self.path)
        except InputError as e:
            if strict:
                raise
            print(f"ie-lab serve: {e}", file=sys.stderr, flush=True)  # once per content: the digest is kept
            users = []
        self._users = users + self._env

    def user(self, header: str | None) -> str | None:
        """The user a request's Authorization header names, or None."""
        with self._lock:
            self._reload()
            users = list(self._users)
        if not header or not header.startswith("Bearer "):
            return None
        given = header[7:].strip().encode()
        found = None
        for name, tok in users:  # every token is compared, whichever matches: the time does not tell which
            if hmac.compare_digest(tok, given) and found is None:
                found = name
        return found

    def count(self) -> int:
        with self._lock:
            self._reload()
            return len(self._users)


__all__ = ["MAKE_TOKEN", "MIN_TOKEN", "TOKENS_ENV", "Tokens"]
