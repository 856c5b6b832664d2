"""The one place that speaks HTTP to engines and the router.

``EngineClient`` (asyncio, aiohttp) for /generate and friends; ``post_json`` / ``get_json`` (blocking,
stdlib) for control calls made from synchronous code such as the weight broadcaster and the fleet.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from megatron_spo.rollout.protocol import (
    Completion,
    GenerateRequest,
    ProtocolError,
    SamplingParams,
    parse_generate_response,
)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router 0.3.2 (smg): src/routers/header_utils.rs, policies/manual.rs


class EngineError(RuntimeError):
    """An engine or router call that failed: HTTP error status, timeout, connection loss or garbage.
    ``retryable`` is False for a 4xx (the request itself is bad: retrying elsewhere will not help)."""

    def __init__(self, url: str, message: str, *, status: int | None = None, retryable: bool = True):
        super().__init__(f"{url}: {message}")
        self.url, self.status, self.retryable = url, status, retryable


class EngineClient:
    """Async client of one base URL (an engine or the router).

        async with EngineClient("http://127.0.0.1:30000", timeout_s=60) as client:
            [[c0, c1]] = await client.generate([prompt_ids], SamplingParams(n=2), return_logprob=True)
    """

    def __init__(self, base_url: str, *, timeout_s: float = 300.0, max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._session = None

    async def __aenter__(self) -> EngineClient:
        await self.session()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None,
                      headers: dict[str, str] | None = None) -> Any:
        """JSON in, JSON (or text) out; any failure becomes an EngineError."""
        import aiohttp

        url = self.base_url + path
        session = await self.session()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with session.request(method, url, json=body, timeout=timeout, headers=headers) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise EngineError(url, f"HTTP {resp.status}: {raw[:300].decode(errors='replace')}",
                                      status=resp.status, retryable=resp.status >= 500 or resp.status == 429)
                if not raw:
                    return None
                try:
                    return json.loads(raw)
                except ValueError:
                    return raw.decode(errors="replace")
        except asyncio.TimeoutError:
            raise EngineError(url, f"timed out after {timeout.total:g} s") from None
        except aiohttp.ClientError as err:
            raise EngineError(url, f"{type(err).__name__}: {err}") from None

    async def generate(self, prompts: list[list[int]], sampling_params: SamplingParams, *,
                       return_logprob: bool = True, rid: str | None = None, lora_path: str | None = None,
                       timeout_s: float | None = None, return_routed_experts: bool = False,
                       routing_key: str | None = None) -> list[list[Completion]]:
        """Completions per prompt ([prompt][sample], n = sampling_params.n). One sampling_params object for
        the whole batch (the router refuses lists); ``lora_path`` the loaded adapter to sample from (None: the
        base); ``routing_key`` sent as the X-SMG-Routing-Key header (sglang-router's manual policy keeps a key on one
        worker; other policies and the engines ignore it). A malformed response raises EngineError."""
        if not prompts:
            return []
        single = len(prompts) == 1
        req = GenerateRequest(input_ids=prompts[0] if single else prompts, sampling_params=sampling_params,
                              return_logprob=return_logprob, rid=rid if single else None, lora_path=lora_path,
                              return_routed_experts=return_routed_experts)
        if routing_key is None:
            body = await self.request("POST", "/generate", req.to_json(), timeout_s)
        else:
            body = await self.request("POST", "/generate", req.to_json(), timeout_s,
                                      headers={ROUTING_KEY_HEADER: routing_key})
        try:
            return parse_generate_response(body, len(prompts), sampling_params.n)
        except ProtocolError as err:
            raise EngineError(self.base_url + "/generate", f"bad response: {err}") from None

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict:
        return await self.request("GET", "/model_info")  # /get_model_info is deprecated in SGLang

    async def server_info(self) -> dict:
        return await self.request("GET", "/server_info")

    async def weight_version(self) -> str | None:
        info = await self.model_info()
        return None if not isinstance(info, dict) else info.get("weight_version")

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")


# -------------------------------------------------------------------------------------------------
# Blocking helpers for control-plane calls
# -------------------------------------------------------------------------------------------------
def post_json(url: str, body: Any, timeout_s: float = 60.0) -> tuple[int, Any]:
    """POST a JSON body -> (status, parsed JSON or text). Connection errors raise OSError."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    return _send(req, timeout_s)


def post_json_bytes(url: str, data: bytes, timeout_s: float = 60.0) -> tuple[int, Any]:
    """POST an already encoded JSON body (one encoding sent to many engines) -> (status, parsed JSON or text)."""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    return _send(req, timeout_s)


def get_json(url: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    return _send(urllib.request.Request(url, method="GET"), timeout_s)


def wait_healthy(urls: Sequence[str], timeout_s: float, poll_s: float = 1.0, *, what: str = "rollout engines",
                 dead: Callable[[str], str | None] | None = None, path: str = "/health") -> None:
    """Block until every URL answers GET ``path`` (/health) with 200. ``dead(url)``, asked at every poll, names
    why the server behind a URL can never answer (its process exited): that is raised at once. RuntimeError
    naming the URLs still pending, each with its last answer, after timeout_s.

    path="/model_info" for engines that may be paused: SGLang's /health runs a one-token generation, which
    waits while generation is paused and answers 503 after 20 s; /model_info answers (once the model loaded)."""
    pending, deadline, last = list(urls), time.monotonic() + timeout_s, {}
    while pending:
        for url in list(pending):
            why = dead(url) if dead is not None else None
            if why:
                raise RuntimeError(why)
            try:
                status, _ = get_json(url.rstrip("/") + path, min(5.0, max(poll_s, 1.0)))
                last[url] = f"HTTP {status}"
                if status == 200:
                    pending.remove(url)
            except OSError as err:
                last[url] = str(err)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout_s:.0f} s: "
                               + ", ".join(f"{u} ({last[u]})" for u in pending))
        if pending:
            time.sleep(poll_s)


def _send(req: urllib.request.Request, timeout_s: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")
