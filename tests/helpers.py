"""Test-only pieces: a two-expert method, a callback that SIGKILLs its own process, quick trainers."""
from __future__ import annotations

import os
import signal

from typing import Optional

import torch
from lightning.pytorch import Callback, Trainer

from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.modules.world.geneval import SyntheticGenEval, windows
from posttrain.modules.rewards.base import Reward
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.flow.losses import flow_matching_loss, noised


class TwoExperts(ExpertModule):
    """Finetune two generators (``transformer`` and ``critic``) on the same batch, two optimizers."""

    def __init__(self, card: ModelCard, seed: int = 0, nan_at: Optional[int] = None, max_nan_steps: int = 3):
        super().__init__(card, run=RunArgs(seed=seed, max_nan_steps=max_nan_steps))
        self.nan_at = nan_at
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]))
        for name in ("transformer", "critic"):
            sigma = torch.rand(x0.shape[0], generator=self.generator)
            noise = torch.randn(x0.shape, generator=self.generator)
            with self.stage.velocity(name) as velocity:
                v = velocity(noised(x0, noise, sigma), self.sampler.timestep_of(sigma), cond)
            loss = flow_matching_loss(v, x0, noise)[0].mean()
            if self.nan_at is not None and self.calls >= self.nan_at and name == "transformer":
                loss = loss * float("nan")
            self.step_experts(loss, [name])
            self.log(f"train/loss/{name}", loss)

    @torch.no_grad()
    def validation_step(self, batch, batch_idx):
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]))
        sigma = torch.full((x0.shape[0],), 0.5)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(batch_idx))
        with self.stage.velocity("transformer") as velocity:
            v = velocity(noised(x0, noise, sigma), self.sampler.timestep_of(sigma), cond)
        self.log("val/loss", flow_matching_loss(v, x0, noise)[0].mean(), batch_size=x0.shape[0])


class KillAt(Callback):
    """SIGKILL this process at the end of iteration ``iteration`` (a real crash, no clean-up)."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.iteration:
            os.kill(os.getpid(), signal.SIGKILL)


# quantities of one expert: always logged as train/<quantity>/<expert>, never bare
PER_EXPERT = {"loss", "kl", "policy_loss", "ppo_ratio_mean", "clip_frac", "approx_kl", "kept_samples", "tokens",
              "positive_loss", "negative_loss", "decay", "dmd_grad_abs", "dmd_normalizer", "grad_norm", "lr", "version",
              "nan_skipped"}


def assert_one_metric_scheme(metrics, card: ModelCard) -> None:
    """Every per-expert training metric is ``train/<quantity>/<expert>`` with a component of ``card``."""
    components = set(card.models) | set(card.roles)
    per_expert = [key.split("/") for key in metrics if key.split("/")[:1] == ["train"]
                  and key.split("/")[1] in PER_EXPERT]
    assert per_expert, sorted(metrics)
    for parts in per_expert:
        assert len(parts) == 3 and parts[2] in components, "/".join(parts)


def quick_trainer(max_steps: int, **kwargs) -> Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0)
    defaults.update(kwargs)
    return Trainer(**defaults)


def fit_checkpointed(module, folder, steps: int, ckpt_path=None, num_samples: int = 8, every: int = 2,
                     save_top_k: int = -1, callbacks=(), **trainer_kwargs) -> Trainer:
    """Fit ``module`` for ``steps`` iterations on synthetic videos (5 frames of 16x16, batches of 2) with the
    package's ModelCheckpoint in ``folder`` (every ``every`` iterations, ``last`` kept), from ``ckpt_path``; the
    ``quick_trainer`` (``trainer_kwargs`` on top), which it returns."""
    callback = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=every, save_last=True, save_top_k=save_top_k)
    trainer = quick_trainer(steps, enable_checkpointing=True, callbacks=[callback, *callbacks], **trainer_kwargs)
    trainer.fit(module, SyntheticVideos(num_samples=num_samples, batch_size=2, frames=5, height=16, width=16),
                ckpt_path=ckpt_path)
    return trainer


class NaNReward(Reward):
    """A broken reward: NaN for every other sample."""

    def __call__(self, media, prompts, context=None):
        values = torch.zeros(len(prompts))
        values[::2] = float("nan")
        return values


def tiny_clip_folder(path: str) -> str:
    """A local transformers CLIP folder (random tiny ``CLIPModel``, ``CLIPProcessor`` with a byte-level BPE
    vocabulary written here and no merges): what ``CLIPScore`` reads, made without any download."""
    import json

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    os.makedirs(path, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    tokenizer = CLIPTokenizer(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77,
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16))
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def late_windows(videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Synthetic GenEval of the 5-frame windows ending on latent frames 2 .. 5 (``modules.geneval.windows``): the
    latent frames after the first, where a long clip's continuation shows."""
    metric = SyntheticGenEval()
    for window in windows(videos)[1:]:
        metric.update(window, prompts)
    return {k: float(v) for k, v in metric.compute().items()}


def fit_shipped_config_once(config: str, folder, data: Optional[dict] = None) -> None:
    """``posttrain fit --config configs/<config>`` in this process for one iteration on ``data`` (a class_path and
    init_args; default: 4 synthetic clips for a finetune config or one on synthetic clips, 2 synthetic prompts for
    another), no validation and no logger (a second W&B run in one process would join the first one's); its last
    checkpoint is written under ``folder``."""
    import json

    import yaml

    from posttrain.lit.tools.cli import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if data is None:
        with open(os.path.join(root, "configs", config)) as f:
            clips = config.startswith("finetune") or yaml.safe_load(f)["data"]["class_path"] == "SyntheticVideos"
        data = {"class_path": "SyntheticVideos", "init_args": {"num_samples": 4, "batch_size": 2}} if clips \
            else {"class_path": "Prompts", "init_args": {"num_synthetic": 2, "batch_size": 1}}

    main(["fit", "--config", os.path.join(root, "configs", config), "--trainer.max_steps", "1",
          "--trainer.default_root_dir", str(folder), "--trainer.limit_val_batches", "0",
          "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
          "--data", json.dumps(data)])
    assert os.path.exists(os.path.join(folder, "checkpoints", "last.ckpt"))


def dmd2_steps_student_and_critic_twice(module, prompts: list[str], data=None) -> None:
    """Two DMD2 iterations of ``module`` (student ``transformer`` and ``critic`` from the frozen ``teacher`` by
    ``init_from``, the student stepping every iteration) on ``prompts`` (or on ``data``, a datamodule: an
    image-to-video student's captioned clips): student and critic start as the teacher, both move and reach version 2,
    the teacher stays bit for bit at version 0, the losses and the DMD gradient are finite, and the metrics follow the
    one naming scheme."""
    from posttrain.datamodules.prompts import Prompts

    card = module.card
    module.configure_model()
    names = ("teacher", "transformer", "critic")
    before = {name: {k: v.detach().clone() for k, v in card[name].state_dict().items()} for name in names}
    for name in ("transformer", "critic"):  # init_from
        assert all(torch.equal(v, before[name][k]) for k, v in before["teacher"].items()), name  # (and a GAN head)
    trainer = quick_trainer(2, log_every_n_steps=1)
    trainer.fit(module, data or Prompts(prompts=prompts, batch_size=2))
    after = {name: card[name].state_dict() for name in names}
    assert all(torch.equal(before["teacher"][k], v) for k, v in after["teacher"].items())
    for name in ("transformer", "critic"):
        assert any(not torch.equal(before[name][k], v) for k, v in after[name].items()), name
    assert (card.versions["transformer"], card.versions["critic"], card.versions["teacher"]) == (2, 2, 0)
    metrics = trainer.callback_metrics
    assert all(torch.isfinite(metrics[f"train/loss/{name}"]) for name in ("transformer", "critic"))
    assert torch.isfinite(metrics["train/dmd_grad_abs/transformer"])
    assert_one_metric_scheme(metrics, card)


def joint_rl_steps_refiner_and_generator(module, prompts: list[str]) -> None:
    """One joint-RL iteration of ``module`` (one refiner ``refiner_0`` appending to each request, the generator
    ``transformer``) on ``prompts``: the rollout's log-probabilities (the generator's SDE steps, the refiner's tokens)
    recompute at its weights, both experts step once (a version each) and move, their frozen KL references and the
    text encoder stay at version 0, and the served captions are each request followed by its refinement."""
    from posttrain.callbacks.parity import LogProbParityCheck
    from posttrain.datamodules.prompts import Prompts

    card = module.card
    module.configure_model()
    experts = ["refiner_0", "transformer"]
    before = {name: {k: v.detach().clone() for k, v in card[name].state_dict().items()} for name in experts}
    parity = LogProbParityCheck(every_n_iterations=1, tolerance=1e-5)
    trainer = quick_trainer(1, log_every_n_steps=1, callbacks=[parity])
    trainer.fit(module, Prompts(prompts=prompts, batch_size=2))
    assert trainer.global_step == 1 and len(trainer.optimizers) == 2
    assert parity.checks == 1 and parity.last_gap < 1e-5
    for name in experts:
        assert any(not torch.equal(before[name][k], v) for k, v in card[name].state_dict().items()), name
    assert {name: card.versions[name] for name in [*experts, "refiner_0_reference", "transformer_reference",
                                                   "text_encoder"]} == \
        {"refiner_0": 1, "transformer": 1, "refiner_0_reference": 0, "transformer_reference": 0, "text_encoder": 0}
    metrics = trainer.callback_metrics
    assert sorted(k for k in trainer.logged_metrics if k.startswith("train/grad_norm/")) == \
        [f"train/grad_norm/{name}" for name in experts]
    assert all(torch.isfinite(metrics[f"train/loss/{name}"]) for name in experts)
    assert_one_metric_scheme(metrics, card)
    module.generate(prompts, seed=0)  # served through the refiner: each request, then its refinement
    assert all(c.startswith(f"{p} → {p}, ") for c, p in zip(module.sample_captions(prompts), prompts))
