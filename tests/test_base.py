"""The base's guarantees every method relies on: no gradient leaks between experts, per-step backward."""
from __future__ import annotations

import pytest
import torch

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import ExpertModule, GradientLeakError, RunArgs
from posttrain.modules.models.cards import Expert
from posttrain.modules.flow.losses import flow_matching_loss, noised
from tests.conftest import adamw, wan_card
from tests.helpers import quick_trainer

SIZE = RunArgs(frames=5, height=16, width=16)


def videos(num_samples: int):
    """Training batches alone: these modules have no ``validation_step``."""
    return SyntheticVideos(num_samples=num_samples, batch_size=2).train_dataloader()


class Leaky(ExpertModule):
    """The student's loss reads the critic's output *with* grad (a forgotten ``no_grad``) — or not."""

    def __init__(self, card, leak: bool):
        super().__init__(card, run=SIZE)
        self.leak = leak

    def training_step(self, batch, batch_idx):
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]))
        sigma = torch.full((x0.shape[0],), 0.5)
        noise = torch.randn(x0.shape, generator=self.generator)
        t = self.sampler.timestep_of(sigma)
        with self.stage.velocity("transformer") as student:
            v = student(noised(x0, noise, sigma), t, cond)
        with torch.set_grad_enabled(self.leak), self.stage.velocity("critic") as critic:
            v_fake = critic(noised(x0, noise, sigma), t, cond)
        loss = flow_matching_loss(v, x0, noise)[0].mean() + (v.float() - v_fake.float()).pow(2).mean()
        self.step_experts(loss, ["transformer"])


def card():
    return wan_card(extra={"critic": Expert(arch="wan_t2v", trainable=True, optimizer=adamw())})


def test_a_backward_into_an_expert_not_stepped_is_refused():
    """A loss meant for the student that reaches the critic's parameters stops the run naming both, before
    the critic's next step could take those gradients; with the critic under no_grad it trains."""
    module = Leaky(card(), leak=True)
    module.configure_model()
    critic = {k: v.clone() for k, v in module.card["critic"].state_dict().items()}
    with pytest.raises(GradientLeakError, match=r"meant for \['transformer'\] would write gradients into \['critic'\]"):
        quick_trainer(max_steps=2).fit(module, videos(4))
    assert all(torch.equal(v, module.card["critic"].state_dict()[k]) for k, v in critic.items())
    clean = Leaky(card(), leak=False)
    quick_trainer(max_steps=2).fit(clean, videos(4))
    assert clean.card.versions["transformer"] == 2 and clean.card.versions["critic"] == 0


def test_accumulating_gradients_of_another_expert_are_not_a_leak():
    """An expert that accumulates over iterations holds gradients between its steps; another expert's
    backward leaves them as they are, and that is no leak."""
    c = wan_card(extra={"critic": Expert(arch="wan_t2v", trainable=True, optimizer=adamw(), accumulate=2)})

    class Alternate(ExpertModule):
        def training_step(self, batch, batch_idx):
            x0 = self.stage.encode(batch["video"])
            cond = self.stage.condition(list(batch["prompt"]))
            sigma = torch.full((x0.shape[0],), 0.5)
            noise = torch.randn(x0.shape, generator=self.generator)
            for name in ("critic", "transformer"):
                with self.stage.velocity(name) as velocity:
                    v = velocity(noised(x0, noise, sigma), self.sampler.timestep_of(sigma), cond)
                self.step_experts(flow_matching_loss(v, x0, noise)[0].mean(), [name])

    module = Alternate(c, run=SIZE)
    quick_trainer(max_steps=3).fit(module, videos(6))
    assert module.card.versions["transformer"] == 3 and module.card.versions["critic"] == 1


class CriticReadsStudent(ExpertModule):
    """The critic's loss takes the student's sample without ``detach`` (the other direction of a leak); with
    ``hidden`` the critic runs inside a reentrant checkpoint fed that sample."""

    def __init__(self, card, detach: bool, hidden: bool = False):
        super().__init__(card, run=SIZE)
        self.detach, self.hidden = detach, hidden

    def training_step(self, batch, batch_idx):
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]))
        sigma = torch.full((x0.shape[0],), 0.5)
        noise = torch.randn(x0.shape, generator=self.generator)
        t = self.sampler.timestep_of(sigma)
        with self.stage.velocity("transformer") as student:
            sample = noised(x0, noise, sigma) - 0.5 * student(noised(x0, noise, sigma), t, cond).float()
        if self.detach:
            sample = sample.detach()
        with self.stage.velocity("critic") as critic:
            if self.hidden:  # the graph shows a CheckpointFunction, not the critic's parameters
                v = torch.utils.checkpoint.checkpoint(lambda x: critic(x, t, cond), noised(sample, noise, sigma),
                                                      use_reentrant=True)
            else:
                v = critic(noised(sample, noise, sigma), t, cond)
        self.step_experts(flow_matching_loss(v, sample.detach(), noise)[0].mean(), ["critic"])


def test_a_critic_loss_reaching_the_student_is_refused():
    """The reverse direction: a critic loss on a non-detached student sample is refused before its backward
    (the student's weights and gradients untouched); detached, the critic trains and the student never steps."""
    module = CriticReadsStudent(card(), detach=False)
    with pytest.raises(GradientLeakError, match=r"meant for \['critic'\] would write gradients into \['transformer'\]"):
        quick_trainer(max_steps=1).fit(module, videos(4))
    assert all(p.grad is None for p in module.card["transformer"].parameters())
    clean = CriticReadsStudent(card(), detach=True)
    quick_trainer(max_steps=2).fit(clean, videos(4))
    assert clean.card.versions["critic"] == 2 and clean.card.versions["transformer"] == 0


class HiddenLeak(ExpertModule):
    """A student loss that runs the critic inside a reentrant checkpoint on an input carrying the student's grad:
    the loss graph shows a CheckpointFunction, not the critic's parameters, yet the backward recomputes the critic
    with grad and writes into it."""

    def __init__(self, card):
        super().__init__(card, run=SIZE)

    def training_step(self, batch, batch_idx):
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]))
        sigma = torch.full((x0.shape[0],), 0.5)
        noise = torch.randn(x0.shape, generator=self.generator)
        t = self.sampler.timestep_of(sigma)
        with self.stage.velocity("transformer") as student:
            v = student(noised(x0, noise, sigma), t, cond).float()
        with self.stage.velocity("critic") as critic:
            v_fake = torch.utils.checkpoint.checkpoint(lambda x: critic(x, t, cond).float(),
                                                       noised(x0, noise, sigma) - 0.1 * v, use_reentrant=True)
        self.step_experts(flow_matching_loss(v, x0, noise)[0].mean() + v_fake.pow(2).mean(), ["transformer"])


def test_a_leak_hidden_from_the_graph_is_caught_after_the_backward():
    """The graph check cannot see through a reentrant checkpoint; the gradient check after the backward does, and
    stops the run before the critic's next step."""
    module = HiddenLeak(card())
    module.configure_model()
    with pytest.raises(GradientLeakError, match=r"meant for \['transformer'\] wrote gradients into \['critic'\]"):
        quick_trainer(max_steps=1).fit(module, videos(4))


def test_float16_mixed_precision_is_refused_with_the_fix():
    from posttrain.lit.finetune import Finetune

    from lightning.pytorch.plugins import MixedPrecision

    module = Finetune(wan_card(), run=SIZE)
    float16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # what `16-mixed` is on a GPU
    with pytest.raises(ValueError, match=r"precision=16-mixed.*use `precision: bf16-mixed`"):
        quick_trainer(max_steps=1, plugins=[float16]).fit(module, SyntheticVideos(num_samples=4, batch_size=2))


def test_embedding_cache_size_and_host_rows():
    """`cache_size` bounds the rows kept (least recently used go first); `cache_device: cpu` keeps them in host
    memory; rows keep the encoder's dtype."""
    from posttrain.modules.models.generators import GeneratorStage

    card = wan_card(cache_size=2, cache_device="cpu")
    card.build()
    stage = GeneratorStage(card)
    stage.condition(["a", "b", "c"])
    assert len(card.cache) == 2 and card.cache.misses == 3
    assert all(row.device.type == "cpu" and row.dtype == torch.float32 for row in card.cache._store.values())
    with pytest.raises(ValueError, match="cache_size=0 must be >= 1"):
        wan_card(cache_size=0)
    with pytest.raises(ValueError, match="attention_backend is a diffusers option"):
        wan_card(extra={"text_encoder": Expert(arch="umt5", attention_backend="flash")})
