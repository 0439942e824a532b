"""Who may use the UI: with a token, only requests that carry it (in ?token=, a cookie the first visit sets, or an
Authorization: Bearer header); without one (localhost only), only requests whose Host is a local name, so that a web
page cannot reach the UI through a DNS name it controls. A POST must be JSON from the UI's own origin, so that
another site's form cannot start a job."""

from __future__ import annotations

import hmac
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from starlette.responses import JSONResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "toolkit_ui_token"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _hostname(host: str) -> str:
    if host.startswith("["):  # [::1]:8642
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class TokenGate:
    """ASGI middleware: 401 without the token, 403 for a foreign Host (no token) or a cross-site POST."""

    def __init__(self, app: ASGIApp, token: str | None, local_only: bool):
        self.app = app
        self.token = token
        self.local_only = local_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.local_only and _hostname(host) not in LOCAL_HOSTS:
            await JSONResponse({"error": f"Host {host!r} is not a local name: this UI serves localhost only"},
                               403)(scope, receive, send)
            return
        if scope["method"] == "POST":
            origin = headers.get("origin")
            if origin and urlsplit(origin).netloc != host:
                await JSONResponse({"error": "cross-site request refused"}, 403)(scope, receive, send)
                return
            if not headers.get("content-type", "").startswith("application/json"):
                await JSONResponse({"error": "send JSON (Content-Type: application/json)"}, 415)(scope, receive, send)
                return
        if self.token is not None:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
            cookie = SimpleCookie(headers.get("cookie", "")).get(COOKIE)
            bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
            given = [g for g in (query, cookie.value if cookie else "", bearer) if g]
            if not any(hmac.compare_digest(g.encode(), self.token.encode()) for g in given):
                await JSONResponse({"error": "this UI needs its token: open the URL it printed (…/?token=...)"},
                                   401)(scope, receive, send)
                return
            if query and scope["path"] == "/":  # the printed URL: keep the token in a cookie, out of the address bar
                response = RedirectResponse("/", 303)
                response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
