"""``posttrain serve-reward``: any ``Reward`` behind an HTTP server (FastAPI + uvicorn), for ``RemoteReward``.

    posttrain serve-reward --reward PickScore --reward.path /models/pickscore --port 8000
    posttrain serve-reward --reward SyntheticGenEvalReward --port 8000 --batch_size 16
    POSTTRAIN_REWARD_TOKEN=<secret> posttrain serve-reward --reward ... --host 0.0.0.0 --allow_remote true

The wire format is ``modules/rewards/remote.py``'s. The reward is built once, before the server listens (a folder that
cannot serve stops here); batches are scored one at a time (a model on one device is not shared between
threads), each request in chunks of at most ``batch_size`` samples, and every answer is checked
(``check_reward_output``) before it leaves. Only loopback addresses are served unless ``allow_remote`` is set,
and then only with a token.
"""
# no `from __future__ import annotations`: FastAPI reads the route handlers' annotations (Request) at definition
import contextlib
import hmac
import ipaddress
import socket
import sys
import threading
from typing import Any, Iterator, Optional

import torch

from posttrain.modules.rewards.remote import (PROTOCOL, TOKEN_ENV, decode_request, encode_answer, token_from)
from posttrain.modules.rewards.base import Reward, RewardOutput, reward_name, score


def chunk_context(context: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The context of the samples ``rows`` (every per-sample list and stage tensor sliced)."""
    out: dict[str, Any] = {}
    for key, value in context.items():
        if key == "stages":
            out[key] = {k: v[rows] for k, v in value.items()}
        elif key == "refinements":
            out[key] = {k: list(v)[rows] for k, v in value.items()}
        elif isinstance(value, list):
            out[key] = value[rows]
        else:
            out[key] = value
    return out


def score_batch(reward: Reward, media: torch.Tensor, prompts: list[str], context: dict[str, Any],
                batch_size: Optional[int]) -> RewardOutput:
    """``score`` of the whole batch, in chunks of ``batch_size`` samples (None: at once)."""
    if batch_size is None or len(prompts) <= batch_size:
        return score(reward, media, prompts, context or None)
    parts = []
    for start in range(0, len(prompts), batch_size):
        rows = slice(start, start + batch_size)
        parts.append(score(reward, media[rows], prompts[rows], chunk_context(context, rows) or None))
    terms = parts[0].terms.keys()
    return RewardOutput(torch.cat([p.total for p in parts]), {k: torch.cat([p.terms[k] for p in parts]) for k in terms})


def make_app(reward: Reward, token: Optional[str] = None, batch_size: Optional[int] = None,
             device: Optional[str] = None):
    """The FastAPI app serving ``reward``: ``GET /health``, ``POST /score``."""
    from fastapi import FastAPI, HTTPException, Request, Response
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title=f"posttrain reward server: {reward_name(reward)}")
    lock = threading.Lock()
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def authorize(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, f"this reward server needs its token: send `Authorization: Bearer <token>` "
                                     f"(RemoteReward's `token:` or ${TOKEN_ENV})")

    def run(media: torch.Tensor, prompts: list[str], context: dict[str, Any]) -> bytes:
        with lock:
            media = media.to(target)
            if "stages" in context:
                context["stages"] = {k: v.to(target) for k, v in context["stages"].items()}
            return encode_answer(score_batch(reward, media, prompts, context, batch_size), reward_name(reward))

    @app.get("/health")
    def health(request: Request) -> dict:
        authorize(request)
        return {"reward": reward_name(reward), "protocol": PROTOCOL}

    @app.post("/score")
    async def score_route(request: Request) -> Response:
        authorize(request)
        try:
            media, prompts, context = decode_request(await request.body())
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        try:
            body = await run_in_threadpool(run, media, prompts, context)
        except (TypeError, ValueError, KeyError) as err:  # the reward refused this batch: retrying will not help
            raise HTTPException(422, f"reward {reward_name(reward)!r}: {err}") from None
        return Response(body, media_type="application/octet-stream")

    return app


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (socket.gaierror, ValueError):
        return False


def bind(host: str, port: int, token: Optional[str], allow_remote: bool) -> socket.socket:
    """A listening socket on (host, port); anything but loopback needs ``allow_remote`` and a token."""
    if not is_loopback(host):
        missing = [what for what, ok in (("--allow_remote true", allow_remote),
                                         (f"a token (--token or ${TOKEN_ENV})", token)) if not ok]
        if missing:
            raise ValueError(f"serve-reward: --host {host} is reachable from other machines; that needs "
                             f"{' and '.join(missing)}, so that only clients holding the token are scored "
                             f"(or serve on --host 127.0.0.1)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"serve-reward: cannot listen on {host}:{port} ({err.strerror}); choose another --port "
                         f"(0 picks a free one)") from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, fd=None, lifespan="off"))


def serve_reward(reward: Reward, host: str = "127.0.0.1", port: int = 8000, token: Optional[str] = None,
                 allow_remote: bool = False, batch_size: Optional[int] = None, device: Optional[str] = None,
                 threads: Optional[int] = None) -> None:
    """Serve a reward over HTTP for ``RemoteReward`` (FastAPI + uvicorn): ``POST /score`` scores one batch.

    Args:
        reward: the reward to serve, as in a config (``--reward <class_path>`` and ``--reward.<arg> value``).
        host: address to listen on; anything but loopback needs ``allow_remote`` and a token.
        port: port to listen on (0: a free one; the URL is printed).
        token: shared secret every request must carry; None = ``$POSTTRAIN_REWARD_TOKEN`` (keeps it out of the
            process list).
        allow_remote: allow a non-loopback ``host``.
        batch_size: score each request in chunks of at most this many samples (bounds the judge's memory);
            None = a request at once.
        device: where media are put before scoring; None = cuda when available.
        threads: torch's intra-op CPU threads in the server; None = torch's default (all cores). Beside a trainer
            on the same CPU cores give it few: threads of two processes spinning on the same cores slow both.
    """
    token = token_from(token)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"serve-reward: --threads={threads} must be >= 1 (or null: torch's default)")
        torch.set_num_threads(threads)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"serve-reward: --batch_size={batch_size} must be >= 1 (or null: a request at once)")
    sock = bind(host, port, token, allow_remote)
    server = _server(make_app(reward, token, batch_size, device))
    print(f"posttrain serve-reward: {reward_name(reward)} at {url_of(sock)} "
          f"({'token required' if token else 'no token'})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    sys.stdout.flush()


@contextlib.contextmanager
def served(reward: Reward, token: Optional[str] = None, batch_size: Optional[int] = None,
           device: Optional[str] = None, app=None) -> Iterator[str]:
    """``reward`` (or an ``app``) served on a free loopback port by uvicorn in a thread of this process, for tests and
    benchmarks; yields its URL and stops the server on exit."""
    sock = bind("127.0.0.1", 0, token, False)
    server = _server(app or make_app(reward, token, batch_size, device))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the reward server thread stopped before it started")
            threading.Event().wait(0.01)
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
