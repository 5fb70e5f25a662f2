"""A reward in another process: the wire format of ``posttrain serve-reward`` and ``RemoteReward``, its client.

Rewards that do not fit beside the generator (a large judge, a VLM) run in their own process behind a small HTTP
server (``lit/tools/serve_reward.py``); ``RemoteReward`` is a ``Reward`` that sends each batch there. One request
scores one batch:

- ``POST <url>/score``: a safetensors file (``application/octet-stream``) holding ``media`` (B, 3, F, H, W) as
  float32 (exact: the remote reward equals the local one bitwise) or uint8 (``round((x + 1)·127.5)``, 4× smaller,
  what a picture-reading judge sees anyway), the context's stage media as ``stage/<name>``, and in its metadata
  (JSON strings) the prompts and the context's text (``original_prompts``, ``refinements``);
- the answer: a safetensors file of float32 ``total`` (B,) and ``term/<name>`` (B,) each, the reward's name in
  its metadata; an error is an HTTP status with a JSON ``detail``;
- ``GET <url>/health``: ``{"reward": name, "protocol": 1}``.

With a token (``token:``, else the ``POSTTRAIN_REWARD_TOKEN`` environment variable) every request carries
``Authorization: Bearer <token>``. Nothing is unpickled on either side. The client is the standard library's
``urllib`` (one connection per batch, whose cost is small beside a reward model's forward; no dependency).

The client never trains on a reward it did not receive: a server that does not answer (dead, slow past
``timeout``, a 5xx) is retried ``retries`` times with exponential backoff, then the run stops with
``RemoteRewardError`` naming the URL; an answer of the wrong batch size, a non-finite value or another format is
refused naming the URL; a refusal by the server (a 4xx: bad token, a reward that raised) stops at once with the
server's message.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Literal, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from posttrain.modules.rewards.base import Reward, RewardOutput, check_reward_output

PROTOCOL = 1
TOKEN_ENV = "POSTTRAIN_REWARD_TOKEN"
ENCODINGS = ("float32", "uint8")
log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """A reward server did not give a usable reward; the run stops rather than train without it."""


# ---------------------------------------------------------------------- wire format
def encode_media(media: torch.Tensor, encoding: str) -> torch.Tensor:
    media = media.detach().float().cpu()
    if encoding == "uint8":
        return ((media.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return media.contiguous()


def decode_media(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() / 127.5 - 1 if tensor.dtype == torch.uint8 else tensor.float()


def encode_request(media: torch.Tensor, prompts: list[str], context: Optional[dict[str, Any]] = None,
                   encoding: str = "float32") -> bytes:
    """One batch as a safetensors file: media and stage media as tensors, prompts and text context as metadata."""
    context = dict(context or {})
    tensors = {"media": encode_media(media, encoding)}
    for name, stage in (context.pop("stages", None) or {}).items():
        tensors[f"stage/{name}"] = encode_media(stage, encoding)
    try:
        text = json.dumps(context)
    except TypeError as err:
        raise ValueError(f"RemoteReward: the reward context holds {sorted(context)}, which cannot travel to a reward "
                         f"server ({err}); only stage media and JSON values (prompts, refinements) do") from err
    return save_tensors(tensors, metadata={"protocol": str(PROTOCOL), "prompts": json.dumps(list(prompts)),
                                           "context": text})


def _metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors file: its header, an 8-byte length then JSON (read without the tensors)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return header.get("__metadata__") or {}


def decode_request(data: bytes) -> tuple[torch.Tensor, list[str], dict[str, Any]]:
    """(media, prompts, context) of a request body; ``ValueError`` naming what is wrong."""
    try:
        tensors, meta = load_tensors(data), _metadata(data)
        prompts, context = json.loads(meta["prompts"]), json.loads(meta.get("context") or "{}")
    except (SafetensorError, ValueError, KeyError, UnicodeDecodeError) as err:
        raise ValueError(f"the request is not a posttrain reward batch (a safetensors file with `media` and the "
                         f"prompts in its metadata): {err}") from err
    if "media" not in tensors or not isinstance(prompts, list) or not isinstance(context, dict):
        raise ValueError(f"the request holds tensors {sorted(tensors)} and metadata {sorted(meta)}; expected `media` "
                         f"and a list of prompts")
    stages = {k.split("/", 1)[1]: decode_media(v) for k, v in tensors.items() if k.startswith("stage/")}
    if stages:
        context["stages"] = stages
    return decode_media(tensors["media"]), [str(p) for p in prompts], context


def encode_answer(out: RewardOutput, name: str) -> bytes:
    tensors = {"total": out.total.detach().float().cpu().contiguous()}
    tensors.update({f"term/{k}": v.detach().float().cpu().contiguous() for k, v in out.terms.items()})
    return save_tensors(tensors, metadata={"protocol": str(PROTOCOL), "reward": name})


def decode_answer(data: bytes) -> tuple[RewardOutput, str]:
    tensors, meta = load_tensors(data), _metadata(data)
    if "total" not in tensors:
        raise ValueError(f"it holds tensors {sorted(tensors)}, no `total`")
    terms = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("term/")}
    return RewardOutput(tensors["total"], terms), meta.get("reward", "?")


def token_from(token: Optional[str]) -> Optional[str]:
    """``token``, else ``$POSTTRAIN_REWARD_TOKEN``, else None (an empty string counts as none)."""
    return token or os.environ.get(TOKEN_ENV) or None


# ---------------------------------------------------------------------- the client
class RemoteReward(Reward):
    """A reward served by ``posttrain serve-reward`` (any ``Reward``, in its own process or on another machine).

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds to wait for one answer (a large judge on a big batch needs more).
        retries: tries after the first when the server does not answer; then the run stops.
        backoff: seconds before the first retry, doubled for each next one.
        token: the server's shared token; None = ``$POSTTRAIN_REWARD_TOKEN`` (keeps it out of configs).
        encoding: media on the wire: ``float32`` (exact) or ``uint8`` (4× smaller).
        check: ask the server's ``/health`` when the reward is built, so a server that is not up stops the run at
            start-up (with the same retries).
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 token: Optional[str] = None, encoding: Literal["float32", "uint8"] = "float32", check: bool = True):
        parsed = urllib.parse.urlparse(url)
        problems = []
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            problems.append(f"url={url!r} is not an http(s) address; give e.g. http://127.0.0.1:8000")
        if timeout <= 0 or retries < 0 or backoff < 0:
            problems.append(f"timeout={timeout} must be > 0, retries={retries} and backoff={backoff} >= 0")
        if encoding not in ENCODINGS:
            problems.append(f"encoding={encoding!r}; choose one of {list(ENCODINGS)}")
        if problems:
            raise ValueError("RemoteReward:\n  - " + "\n  - ".join(problems))
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.encoding = timeout, retries, backoff, encoding
        self.token = token_from(token)
        self.server_reward: Optional[str] = None
        self.waited = 0.0  # seconds spent waiting on the server (bench/reward_server.py reads it)
        if check:
            self.server_reward = json.loads(self._request("/health", None, "GET"))["reward"]

    @property
    def name(self) -> str:
        return f"RemoteReward({self.url})"

    def _request(self, path: str, body: Optional[bytes], method: str = "POST") -> bytes:
        """The answer's body; retries what may pass (no answer, 5xx), stops at once on a refusal (4xx)."""
        headers = {"Content-Type": "application/octet-stream"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                wait = self.backoff * 2 ** (attempt - 1)
                log.warning("reward server %s: %s; retry %d of %d in %.1f s", self.url, last, attempt, self.retries,
                            wait)
                time.sleep(wait)
            request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    return answer.read()
            except urllib.error.HTTPError as err:
                detail = _detail(err)
                if err.code < 500:
                    hint = (f"; give RemoteReward the server's token (`token:` or ${TOKEN_ENV})"
                            if err.code == 401 and "token" not in detail else "")
                    raise RemoteRewardError(f"reward server {self.url} refused the request (HTTP {err.code}): "
                                            f"{detail}{hint}") from None
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                last = f"no answer ({type(reason).__name__}: {reason})"
            finally:
                self.waited += time.perf_counter() - start
        raise RemoteRewardError(
            f"reward server {self.url} did not answer after {self.retries + 1} tries ({last}); the run stops rather "
            f"than train on a missing reward. Start it (`posttrain serve-reward --reward <class_path> --port "
            f"{urllib.parse.urlparse(self.url).port or 80}`), or raise `retries`/`timeout`, then resume with "
            f"--ckpt_path last")

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        data = self._request("/score", encode_request(media, prompts, context, self.encoding))
        try:
            out, self.server_reward = decode_answer(data)
        except (SafetensorError, ValueError, UnicodeDecodeError) as err:
            raise RemoteRewardError(f"reward server {self.url} answered something that is not a reward answer "
                                    f"({err}); is a posttrain serve-reward server at that address?") from None
        try:
            out = check_reward_output(out, len(prompts), f"{self.server_reward} at {self.url}")
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(f"reward server {self.url} answered a reward that is refused: {err}") from None
        return RewardOutput(out.total.to(media.device), {k: v.to(media.device) for k, v in out.terms.items()})


def _detail(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read()
        return str(json.loads(body).get("detail", body[:200]))
    except (ValueError, AttributeError, OSError):
        return str(err.reason)
