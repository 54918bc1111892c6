"""HTTP for the canary, with the standard library: a GET of text and a POST of JSON.

A server that cannot be reached (refused, reset, timed out, a name that does not resolve) is
Unreachable; one that answers with a status other than 200 is an HTTPFailure carrying the
status and the start of its body (the engine's OpenAI errors say what was wrong there)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

BODY_EXCERPT = 300  # characters of an error's body that a finding quotes


class Unreachable(Exception):
    """No answer from the server."""


class HTTPFailure(Exception):
    """An answer other than 200."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"HTTP {status} from {url}: {body[:BODY_EXCERPT]}")
        self.status = status


def _open(request: urllib.request.Request, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise HTTPFailure(request.full_url, exc.code, exc.read().decode(errors="replace")) from None
    except (urllib.error.URLError, OSError, socket.timeout) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"no answer from {request.full_url}: {reason}") from None


def get_text(url: str, timeout: float) -> str:
    return _open(urllib.request.Request(url), timeout).decode()


def get_json(url: str, timeout: float) -> dict:
    return _decoded(url, get_text(url, timeout))


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return _decoded(url, _open(request, timeout).decode())


def _decoded(url: str, text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        raise HTTPFailure(url, 200, f"not JSON: {text}") from None
