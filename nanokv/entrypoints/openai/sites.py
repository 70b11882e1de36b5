"""Which sites may drive the server: the Host and Origin checks (pure ASGI, before
everything else).

A web page the user opens can send requests to a local server. Two checks keep it out:
- Host (DNS rebinding): a page on evil.example whose name is made to resolve to 127.0.0.1
  talks to the server as its own origin, so the browser lets it read the answers. Its
  requests carry `Host: evil.example`. A request that arrives over loopback must name
  the server by an IP address, `localhost` (or a `*.localhost` name), or a name in
  --allowed-hosts; an IP address or localhost cannot be rebound. A request that arrives
  on another address (a server bound to 0.0.0.0 or a LAN address) may use any name, as
  vLLM allows (nanokv cannot know the names the network gives it), unless
  --allowed-hosts is given: then every request is checked. "*" turns the check off.
- Origin: browsers send it on cross-origin requests. One from a page on another site is
  refused (403) unless the origin is in --allowed-origins, which also turns CORS on for
  it; requests without an Origin (the openai client, curl) and same-origin ones pass.
POST bodies must also be JSON by their Content-Type (api_server.read_json): a page can
send text/plain or a form without asking the server first, but not application/json.
"""

from __future__ import annotations

import ipaddress

from nanokv.entrypoints.openai.protocol import error_body
from nanokv.entrypoints.openai.serving import json_response

def _hostname(host: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _is_loopback(address: str | None) -> bool:
    if address is None:  # not a TCP socket: treat it as local
        return True
    ip = _ip(address.partition("%")[0])
    if ip is None:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class SiteGuard:
    """403 with OpenAI's error object for a Host or an Origin the server does not answer to."""

    def __init__(self, app, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]):
        self.app = app
        hosts = {h.lower().rstrip(".") for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.host_names = {h for h in hosts if not h.startswith(".")}
        self.host_domains = tuple(h for h in hosts if h.startswith("."))
        self.check_every_host = bool(hosts)  # else only requests that arrive over loopback
        self.any_origin = "*" in allowed_origins
        self.origins = {o.lower() for o in allowed_origins}

    def host_allowed(self, host: str, local_address: str | None) -> bool:
        if self.any_host:
            return True
        name = _hostname(host)
        if _ip(name) is not None or name == "localhost" or name.endswith(".localhost"):
            return True  # no DNS name: nothing to rebind
        if name in self.host_names or any(name == d[1:] or name.endswith(d) for d in self.host_domains):
            return True
        return not (self.check_every_host or _is_loopback(local_address))

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().lower()
        if self.any_origin or origin in self.origins:
            return True
        # same origin (a page this host and port served, e.g. through a proxy)
        return host is not None and origin.partition("://")[2] == host.strip().lower()

    def refusal(self, scope) -> str | None:
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin")}
        host = headers[b"host"].decode("latin-1") if b"host" in headers else None
        server = scope.get("server")
        if host is not None and not self.host_allowed(host, server[0] if server else None):
            return (f"the Host header {host[:100]!r} is not a name this server answers to: a web page whose "
                    "name was made to resolve here (DNS rebinding) sends such requests; reach the server by "
                    f"its address or localhost, or start it with --allowed-hosts {_hostname(host)[:100]}")
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), host):
            shown = origin.decode("latin-1")[:100]
            return (f"cross-origin requests are refused (Origin {shown!r}): a web page on another site may "
                    f"not call this server; start it with --allowed-origins {shown} to let it (CORS)")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            message = self.refusal(scope)
            if message is not None:
                await json_response(error_body(403, message), 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
