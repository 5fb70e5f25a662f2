"""The reward server (``posttrain serve-reward``) and its client ``RemoteReward``: the same rewards as the local
reward bitwise, in training too; a dead or slow server retried then stopping the run with its checkpoint intact;
wrong answers, missing tokens and non-loopback binds refused."""
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from lightning.pytorch import Callback

from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.prompts import Prompts
from posttrain.lit.tools.serve_reward import bind, served
from posttrain.modules.io import checkpoints
from posttrain.modules.rewards.remote import RemoteReward, RemoteRewardError, encode_answer, encode_request
from posttrain.modules.rewards.synthetic import ColourAlignment, RefinementKeyword, SyntheticGenEvalReward
from posttrain.modules.rewards.base import Reward, RewardOutput, score
from tests.helpers import NaNReward, quick_trainer
from tests.test_flow_grpo import PROMPTS, make

pytestmark = pytest.mark.usefixtures("one_thread")


def videos(batch=4, seed=0):
    return torch.rand(batch, 3, 5, 16, 16, generator=torch.Generator().manual_seed(seed)) * 2 - 1


class Recorded(Reward):
    """``reward``, keeping every per-sample total it returned."""

    def __init__(self, reward):
        self.reward, self.totals = reward, []

    def __call__(self, media, prompts, context=None):
        out = self.reward(media, prompts, context)
        self.totals.append(out.total.clone())
        return out


@pytest.mark.slow
def test_remote_rewards_equal_the_local_ones_bitwise_and_so_does_training():
    """Float32 media on the wire: total and every term bitwise the local reward's; uint8 media: bitwise the local
    reward of the quantized media. Three flow_grpo iterations against the server end in bitwise the weights (and
    per-iteration rewards) of the same run scored locally."""
    prompts = [PROMPTS[0], PROMPTS[1]] * 2
    for reward in (ColourAlignment(), SyntheticGenEvalReward()):
        local = score(reward, videos(), prompts)
        with served(reward) as url:
            remote = score(RemoteReward(url), videos(), prompts)
            quantized = score(RemoteReward(url, encoding="uint8"), videos(), prompts)
        assert torch.equal(remote.total, local.total) and remote.terms.keys() == local.terms.keys()
        assert all(torch.equal(remote.terms[k], local.terms[k]) for k in local.terms)
        q = ((videos().clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1
        assert torch.equal(quantized.total, score(reward, q, prompts).total)

    runs = {}
    for where in ("local", "remote"):
        torch.manual_seed(0)
        with served(ColourAlignment()) as url:
            seen = Recorded(ColourAlignment() if where == "local" else RemoteReward(url))
            model = make(reward=seen)
            quick_trainer(3).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
        runs[where] = (seen.totals, {k: v.clone() for k, v in model.card["transformer"].state_dict().items()})
    assert len(runs["local"][0]) == 3 and all(t.shape == (8,) for t in runs["local"][0])  # 2 prompts x K=4
    assert all(torch.equal(a, b) for a, b in zip(*(runs[w][0] for w in ("local", "remote"))))
    assert all(torch.equal(v, runs["remote"][1][k]) for k, v in runs["local"][1].items())


class KillServer(Callback):
    """SIGKILL the server process at the end of iteration ``iteration`` (counted here: callbacks run in an order of
    Lightning's, the iteration counter's possibly after this one)."""

    def __init__(self, process, iteration):
        self.process, self.iteration, self.seen = process, iteration, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.iteration:
            self.process.kill()
            self.process.wait()


def start_server(*args) -> tuple[subprocess.Popen, str]:
    """``python -m posttrain serve-reward ... --port 0`` and the URL it prints."""
    process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve-reward", *args, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    seen = ""  # a dependency may log a line before the URL; the server prints it once it listens
    for line in process.stdout:
        if " at http://" in line:
            return process, line.split(" at ")[1].split()[0]
        seen += line
    process.kill()
    raise AssertionError(f"serve-reward did not start: {seen}")


@pytest.mark.slow
def test_a_server_killed_mid_run_is_retried_then_stops_the_run_with_its_checkpoint_intact(tmp_path, caplog):
    """The server process is SIGKILLed after iteration 2: iteration 3's reward is retried twice with backoff,
    then the run stops naming the URL, before any update; the checkpoint of iteration 2 verifies and holds the
    weights the run stopped with."""
    process, url = start_server("--reward", "ColourAlignment")
    try:
        model = make(reward=RemoteReward(url, timeout=5, retries=2, backoff=0.05))
        folder = tmp_path / "checkpoints"
        trainer = quick_trainer(5, enable_checkpointing=True, callbacks=[
            ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_last=True, save_top_k=-1),
            KillServer(process, 2)])
        with caplog.at_level(logging.WARNING, logger="posttrain.modules.rewards.remote"), \
                pytest.raises(RemoteRewardError, match=rf"reward server {url} did not answer after 3 tries \(no answer "
                                                       rf"\(ConnectionRefusedError.*the run stops rather than train "
                                                       rf"on a missing reward"):
            trainer.fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    finally:
        process.kill()
        process.wait()
    retries = [r.getMessage().split("; ")[-1] for r in caplog.records if r.name == "posttrain.modules.rewards.remote"]
    assert retries == ["retry 1 of 2 in 0.1 s", "retry 2 of 2 in 0.1 s"]
    assert trainer.global_step == 2 and model.card.versions["transformer"] == 2
    state = checkpoints.load(str(folder / "last.ckpt"))
    assert state["global_step"] == 2
    saved = {k.split("transformer.", 1)[1]: v for k, v in state["state_dict"].items()
             if ".transformer." in f".{k}" and "reference" not in k}
    current = model.card["transformer"].state_dict()
    assert saved.keys() == current.keys() and all(torch.equal(saved[k], current[k]) for k in current)


def test_a_slow_server_is_retried_then_stops():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/score")
    def slow():
        time.sleep(1.0)

    with served(None, app=app) as url:
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} did not answer after 2 tries \(no answer "
                                                    rf"\((TimeoutError|timeout)"):
            RemoteReward(url, timeout=0.2, retries=1, backoff=0.0, check=False)(videos(), ["a"] * 4)


def answering(out: RewardOutput):
    """A server of the same wire format answering ``out`` to every batch (a buggy or foreign server)."""
    from fastapi import FastAPI, Response

    app = FastAPI()

    @app.post("/score")
    def answer():
        return Response(encode_answer(out, "Faulty"), media_type="application/octet-stream")

    return app


@pytest.mark.parametrize("out, message", [
    (RewardOutput(torch.zeros(3), {}), r"total has shape \(3,\), expected \(4,\)"),
    (RewardOutput(torch.tensor([0.0, float("nan"), 1.0, 2.0]), {}), r"total is not finite for samples \[1\]"),
    (RewardOutput(torch.zeros(4), {"part": torch.zeros(5)}), r"term 'part' has shape \(5,\), expected \(4,\)"),
])
def test_wrong_batch_size_and_nan_answers_are_refused_naming_the_server(out, message):
    with served(None, app=answering(out)) as url:
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} answered a reward that is refused: "
                                                    rf"reward 'Faulty at {url}': {message}"):
            RemoteReward(url, check=False)(videos(), ["a"] * 4)


def test_a_reward_that_fails_on_the_server_stops_at_once_with_its_message():
    with served(NaNReward()) as url:
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} refused the request \(HTTP 422\): reward "
                                                    rf"'NaNReward': reward 'NaNReward': total is not finite"):
            RemoteReward(url, retries=3, backoff=10.0)(videos(), ["a"] * 4)  # no retry: the backoff would show


def test_a_request_without_the_token_is_refused():
    with served(ColourAlignment(), token="s3cret") as url:
        for token in (None, "wrong"):
            with pytest.raises(RemoteRewardError, match=rf"{url} refused the request \(HTTP 401\): this reward server "
                                                        rf"needs its token"):
                RemoteReward(url, token=token)
        body = encode_request(videos(), ["a"] * 4)
        with pytest.raises(urllib.error.HTTPError) as err:  # the scoring route, not only the health check
            urllib.request.urlopen(urllib.request.Request(url + "/score", data=body, method="POST"), timeout=10)
        assert err.value.code == 401
        out = score(RemoteReward(url, token="s3cret"), videos(), ["a red square"] * 4)
        assert torch.equal(out.total, score(ColourAlignment(), videos(), ["a red square"] * 4).total)


def test_binding_beyond_loopback_needs_the_flag_and_a_token(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_REWARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"--host 0.0.0.0 is reachable from other machines; that needs "
                                         r"--allow_remote true and a token"):
        bind("0.0.0.0", 0, None, False)
    with pytest.raises(ValueError, match=r"that needs a token \(--token or \$POSTTRAIN_REWARD_TOKEN\)"):
        bind("0.0.0.0", 0, None, True)
    with pytest.raises(ValueError, match=r"that needs --allow_remote true, so"):
        bind("0.0.0.0", 0, "s3cret", False)
    bind("0.0.0.0", 0, "s3cret", True).close()
    bind("localhost", 0, None, False).close()


def test_the_server_scores_in_chunks_with_the_context_and_a_dead_url_fails_at_construction():
    """batch_size=2 on 5 samples: three reward calls whose per-sample context (refinements) travels and is sliced;
    the answer equals one local call. A RemoteReward on a port nobody serves stops when it is built."""
    reward = RefinementKeyword({"refiner_0": "a", "refiner_1": "sun"})
    context = {"refinements": {"refiner_0": ["aab", "xyz", "a", "b", "aa"],
                               "refiner_1": ["a sun", "noon", "sun", "x", "suns"]},
               "original_prompts": ["p"] * 5}
    with served(reward, batch_size=2) as url:
        remote = score(RemoteReward(url), videos(5), ["q"] * 5, context)
    local = score(reward, videos(5), ["q"] * 5, context)
    assert torch.equal(remote.total, local.total)
    assert all(torch.equal(remote.terms[k], local.terms[k]) for k in local.terms)
    with pytest.raises(RemoteRewardError, match=rf"reward server {url} did not answer after 1 tries"):
        RemoteReward(url, retries=0)
