"""Test helpers for the rollout component: a tiny random Llama + char tokenizer saved to a directory,
engine processes, and fault-injecting servers (an engine that answers 500s or garbage)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    from megatron_spo.rollout.client import get_json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if get_json(url + "/health", 1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@contextmanager
def serving_engine(model_dir: str, timeout_s: float = 120.0) -> Iterator[str]:
    """One `megatron-spo serve` engine of model_dir on a free port, healthy: yields its URL; stopped after."""
    from megatron_spo.net import free_port

    port = free_port()
    engine = start_engine(model_dir, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s)
        yield url
    finally:
        engine.terminate()
        engine.wait(timeout=30)


class FaultyServer:
    """An HTTP server on a thread answering /generate with HTTP 500 ('error'), malformed JSON ('garbage')
    or nothing for 30 s ('slow'); /health is fine, so only the response exposes it."""

    def __init__(self, port: int, kind: str):
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

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
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

    def __init__(self, engine, port: int, **kw):
        import asyncio

        from megatron_spo.rollout.engine_server import EngineServer

        self.engine, self.port = engine, port
        self.url = f"http://127.0.0.1:{port}"
        self.server = EngineServer(engine, host="127.0.0.1", port=port, **kw)
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
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
