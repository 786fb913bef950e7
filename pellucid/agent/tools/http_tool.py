"""The `http` tool: a JSON API call (GET or POST) with httpx, only to hosts on an allow-list.

The host check runs before any connection; redirects are reported, never followed, so an allowed
host cannot bounce the agent elsewhere; responses are cut to ~4000 characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import httpx

from .tool import Tool, ToolError, tool

_MAX_CHARS = 4000


def make_http_tool(
    allow_hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1"), timeout_s: float = 10
) -> Tool:
    """An "http" tool that may only reach `allow_hosts` (host names or IPs, any port)."""
    allowed = frozenset(h.strip("[]").lower() for h in allow_hosts)
    listed = ", ".join(sorted(allowed)) or "none"

    @tool(name="http")
    def http(url: str, method: Literal["GET", "POST"] = "GET", body: dict | None = None) -> str:
        """Call a JSON HTTP API and return the status line and the response body.

        Args:
            url: The full URL, e.g. "http://127.0.0.1:8000/v1/models".
            method: GET, or POST to send `body` as JSON.
            body: The JSON object to POST; leave out for GET.
        """
        try:
            parsed = httpx.URL(url)  # the same parser httpx connects with: no host confusion
        except httpx.InvalidURL as e:
            raise ToolError(f"http: invalid URL {url!r}: {e}") from None
        if parsed.scheme not in ("http", "https"):
            raise ToolError(f"http: only http:// and https:// URLs are allowed, not {url!r}")
        host = parsed.host.lower()
        if host not in allowed:
            raise ToolError(
                f"http: host {host!r} is not on the allow-list ({listed}); to allow it, create "
                f"the tool with make_http_tool(allow_hosts=[..., {host!r}])"
            )
        if method == "GET" and body is not None:
            raise ToolError("http: a GET request has no body; use method POST to send one")
        return _request(method, url, body, timeout_s)

    return http


def _request(method: str, url: str, body: dict | None, timeout_s: float) -> str:
    # trust_env=False: an HTTP(S)_PROXY variable must not route an allowed host elsewhere.
    with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
        try:
            with client.stream(method, url, json=body) as response:
                if response.is_redirect:
                    location = response.headers.get("location", "?")
                    return (
                        f"HTTP {response.status_code}: redirect to {location} (not followed; "
                        "call http again with that URL if its host is allowed)"
                    )
                text, cut = _read_capped(response)
        except httpx.HTTPError as e:
            raise ToolError(f"http: {method} {url} failed: {e or type(e).__name__}") from None
    status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
    return f"{status}\n{text}" + (f"\n[... cut at {_MAX_CHARS} characters]" if cut else "")


def _read_capped(response: httpx.Response) -> tuple[str, bool]:
    """The body's first _MAX_CHARS characters, reading no more than needed from the socket."""
    data = b""
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > 4 * _MAX_CHARS:  # UTF-8 is at most 4 bytes a character
            break
    text = data.decode(response.charset_encoding or "utf-8", errors="replace")
    return text[:_MAX_CHARS], len(text) > _MAX_CHARS
