"""Test helpers for the rollout component: a tiny random Llama + char tokenizer saved to a directory,
engine processes, and fault-injecting servers (an engine that answers 500s or garbage)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=()[]{}<>.,:;!?'\"\n")
SPECIALS = ["<pad>", "<s>", "</s>"]


def make_tiny_llama(path: str, *, seed: int = 0, hidden: int = 32, layers: int = 2, tie: bool = False) -> str:
    """A random LlamaForCausalLM (~50K params) with a char-level PreTrainedTokenizerFast, saved at path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def perturbed_state_dict(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights with fresh random noise: a 'new policy version' with the same names/shapes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.5 * torch.randn(t.shape, generator=gen)).contiguous() for n, t in model.state_dict().items()}


def engine_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get(
        "PYTHONPATH", "")
    return env


def start_engine(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_spo.cli", "serve", "--model", model_dir, "--port",
                             str(port), "--threads", "1", "--log-level", "warning", *extra],
                            env=engine_env(), start_new_session=True)


class ServerExited(RuntimeError):
    """A server process ended before it was healthy, on every port tried (``.proc``: the last one)."""

    def __init__(self, message: str, proc: subprocess.Popen):
        super().__init__(message)
        self.proc = proc


def start_on_free_port(start: Callable[[int], subprocess.Popen], what: str, timeout_s: float = 120.0,
                       tries: int = 3) -> tuple[subprocess.Popen, str]:
    """(process, URL) of a server ``start(port)`` launched on a probed port, healthy. A probed port can be taken
    before the server binds it: a server that exits before it is healthy starts again on another port, as the
    fleet's do (rollout/fleet.py); the last exit raises ServerExited. A server that hangs raises at timeout_s."""
    from megatron_spo.net import free_port
    from megatron_spo.rollout.client import wait_healthy as wait

    for attempt in range(1, tries + 1):
        port = free_port()
        proc = start(port)
        url = f"http://127.0.0.1:{port}"
        try:
            wait([url], timeout_s, poll_s=0.1, what=what,
                 dead=lambda _url, proc=proc: f"{what} exited ({proc.returncode})" if proc.poll() is not None
                 else None)
            return proc, url
        except RuntimeError as err:
            if proc.poll() is None:  # not an exit: a timeout
                proc.kill()
                proc.wait(30)
                raise
            if attempt == tries:
                raise ServerExited(f"{err} on each of {tries} ports", proc) from err
    raise AssertionError("unreachable")


@contextmanager
def serving_engine(model_dir: str, timeout_s: float = 120.0) -> Iterator[str]:
    """One `megatron-spo serve` engine of model_dir on a free port, healthy: yields its URL; stopped after."""
    engine, url = start_on_free_port(lambda port: start_engine(model_dir, port), "engine", timeout_s)
    try:
        yield url
    finally:
        engine.terminate()
        engine.wait(timeout=30)


class FaultyServer:
    """An HTTP server on a thread answering /generate with HTTP 500 ('error'), malformed JSON ('garbage')
    or nothing for 30 s ('slow'); /health is fine, so only the response exposes it."""

    def __init__(self, kind: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._reply(200, b'{"model_path": "faulty", "weight_version": "0"}')

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.hits += 1
                if kind == "slow":
                    time.sleep(30)
                    self._reply(500, b'{"error": "too late"}')
                elif kind == "error":
                    self._reply(500, b'{"error": "boom"}')
                else:
                    self._reply(200, b'[{"text": "x", "output_ids": "not-a-list", "meta_info": {}}]')

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # bound here: the OS picks the port
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()  # a 'slow' handler thread is a daemon: it dies with the test process


class ServerThread:
    """An EngineServer (the real aiohttp app around an in-process LocalEngine) on a background event loop,
    so tests reach it over HTTP without paying a process start."""

    def __init__(self, engine, port: int = 0, **kw):
        import asyncio

        from megatron_spo.net import listening_socket
        from megatron_spo.rollout.engine_server import EngineServer

        # port 0: a socket bound and listening now, so no other test's process can take the port meanwhile
        self.sock = listening_socket() if port == 0 else None
        self.engine, self.port = engine, self.sock.getsockname()[1] if self.sock else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = EngineServer(engine, host="127.0.0.1", port=self.port, **kw)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = None

    def __enter__(self) -> ServerThread:
        import asyncio

        from aiohttp import web

        self.thread.start()

        async def up():
            self.runner = web.AppRunner(self.server.build_app(), access_log=None, handler_cancellation=True)
            await self.runner.setup()
            site = web.SockSite(self.runner, self.sock) if self.sock else web.TCPSite(self.runner, "127.0.0.1",
                                                                                      self.port)
            await site.start()

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
