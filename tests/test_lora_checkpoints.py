"""A LoRA expert's checkpoints hold its adapter: the base, rebuilt exactly from its source, is left out with a digest
(``lit/engine/resume.py``), a resume puts it back from the freshly built card and continues bitwise, a changed base
is refused by name, a checkpoint that still holds the base (written before) resumes, and ``posttrain export`` rebuilds
the base from its source. The same under ZeRO-2, whose engine saves without the base and whose gathered weights load
as plain tensors."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.lit.tools.export import export
from posttrain.modules.io import checkpoints as ckpt
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, LoraConfig, ModelCard
from tests.conftest import TINY_WAN, adamw
from tests.helpers import fit_checkpointed, quick_trainer

SIZE = dict(frames=5, height=16, width=16)
BASE = {**TINY_WAN, "ffn_dim": 2048}  # a base many times its adapter, as real ones are


@pytest.fixture
def base(tmp_path) -> str:
    """A tiny Wan transformer as a local pretrained folder: the base a real LoRA run reads from disk."""
    torch.manual_seed(1)
    folder = str(tmp_path / "base")
    presets.build_model("wan_t2v", preset=BASE).save_pretrained(folder)
    return folder


def card(base: str) -> ModelCard:
    lora = LoraConfig(rank=4, alpha=8.0)
    return ModelCard(experts={"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                              "transformer": Expert(arch="wan_t2v", pretrained=base, trainable=True,
                                                    optimizer=adamw(1e-2), lora=lora)},
                     text_max_length=16)


def fit(folder, base: str, steps: int, ckpt_path=None):
    """A LoRA finetune with an EMA copy (a role of the LoRA expert), a checkpoint every 2 iterations."""
    torch.manual_seed(0)
    module = Finetune(card(base), caption_dropout=0.0, ema_decay=0.9, run=RunArgs(**SIZE))
    return module, fit_checkpointed(module, folder, steps, ckpt_path)


@pytest.fixture
def bases_kept(monkeypatch):
    """``with bases_kept():`` checkpoints leave out what they did before LoRA bases were left out: frozen experts
    alone."""
    reloadable = ModelCard.reloadable

    @contextlib.contextmanager
    def kept():
        with monkeypatch.context() as patch:
            patch.setattr(ModelCard, "reloadable",
                          lambda self: [n for n in reloadable(self) if not self.specs[n].trainable])
            yield

    return kept


def assert_same_run(a, b) -> None:
    """Weights (adapter, EMA, base) and optimizer states bitwise equal."""
    (module_a, trainer_a), (module_b, trainer_b) = a, b
    state_a, state_b = module_a.state_dict(), module_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), f"{name} differs between the resumed and the uninterrupted run"
    for opt_a, opt_b in zip(trainer_a.optimizers, trainer_b.optimizers):
        for index, slots in opt_a.state_dict()["state"].items():
            for slot, value in slots.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state_dict()["state"][index][slot]))


def is_base(key: str) -> bool:
    return key.startswith(("card.models.transformer.", "card.models.transformer_ema.")) and "lora_" not in key


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_bitwise(tmp_path, base):
    folder = tmp_path / "ckpt"
    written = fit(folder, base, 2)
    state = ckpt.load(str(folder / "last.ckpt"))
    held = state["state_dict"]
    assert not [k for k in held if is_base(k)], "a base weight of the LoRA expert is in the checkpoint"
    adapter = {k for k in held if k.startswith("card.models.transformer.")}
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter), sorted(adapter)[:5]
    assert {k.replace("transformer_ema.", "transformer.", 1) for k in held
            if k.startswith("card.models.transformer_ema.")} == adapter  # the EMA keeps its own adapter
    frozen = state["posttrain"]["frozen"]
    assert set(frozen) == {"text_encoder", "vae", "transformer", "transformer_ema"}
    assert frozen["transformer"]["source"]["pretrained"] == base
    assert frozen["transformer"]["sha256"] == written[0].card.weights_digest("transformer", frozen_only=True)
    assert frozen["transformer_ema"] == {"base_of": "transformer"}

    # much smaller than the full model's state: the file is the adapters, their optimizer state and the run state
    full = sum(t.numel() * t.element_size() for t in written[0].card.models["transformer"].state_dict().values())
    size = os.path.getsize(folder / "last.ckpt" / ckpt.STATE)
    print(f"LoRA checkpoint {size:,} B; the LoRA expert's full state {full:,} B (x2 with its EMA copy)")
    assert size < full / 8, (size, full)
    adapters = sum(t.numel() * t.element_size() for t in held.values())  # the expert's and its EMA's
    assert adapters == 2 * sum(t.numel() * t.element_size() for k, t in written[0].card.models["transformer"]
                               .state_dict().items() if "lora_" in k)

    resumed = fit(folder, base, 4, ckpt_path="last")
    straight = fit(tmp_path / "straight", base, 4)
    assert_same_run(resumed, straight)


def test_a_changed_lora_base_is_refused_by_name(tmp_path, base):
    fit(tmp_path / "ckpt", base, 2)
    model = presets.build_model("wan_t2v", pretrained=base)
    with torch.no_grad():
        model.blocks[0].attn1.to_q.weight[0, 0] += 1.0
    model.save_pretrained(base)
    with pytest.raises(ValueError, match=r"the base of LoRA expert 'transformer' is not the one this checkpoint's "
                                         r"adapter was trained on: its source \(.*base\) changed since .*holds the "
                                         r"adapter alone. Restore that source"):
        fit(tmp_path / "ckpt", base, 4, ckpt_path="last")


def test_a_checkpoint_that_holds_the_base_still_resumes_bitwise(tmp_path, base, bases_kept):
    """A checkpoint written before LoRA bases were left out (every weight of the LoRA expert inside) resumes: its
    base loads as it is, and the run continues as the uninterrupted one does."""
    folder = tmp_path / "ckpt"
    with bases_kept():
        fit(folder, base, 2)
    held = ckpt.load(str(folder / "last.ckpt"))
    assert [k for k in held["state_dict"] if is_base(k)] and "transformer" not in held["posttrain"]["frozen"]
    resumed = fit(folder, base, 4, ckpt_path="last")
    assert_same_run(resumed, fit(tmp_path / "straight", base, 4))


def test_export_from_an_adapter_only_checkpoint(tmp_path, base):
    """``posttrain export`` of a checkpoint without the base: the adapter alone, and the model with its base read
    from the source, the served (EMA) adapter on it, equal to the run's served model."""
    from diffusers import WanTransformer3DModel
    from safetensors import safe_open

    from posttrain.modules.io import lora

    module, _ = fit(tmp_path / "ckpt", base, 2)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    adapter = export(last, str(tmp_path / "adapter"))
    with safe_open(os.path.join(adapter, lora.FILES["diffusers"]), "pt") as f:
        assert f.keys() and all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    merged = WanTransformer3DModel.from_pretrained(export(last, str(tmp_path / "merged"), pipeline=False,
                                                          lora="merged"))
    served = module.card.models["transformer_ema"]
    served.fuse_lora(lora_scale=1.0)
    served.unload_lora()
    ours, theirs = served.state_dict(), merged.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    source = presets.build_model("wan_t2v", pretrained=base).state_dict()
    assert not torch.equal(theirs["blocks.0.attn1.to_q.weight"], source["blocks.0.attn1.to_q.weight"])  # the adapter


# ---------------------------------------------------------------------- a ZeRO-2 LoRA expert
def fit_zero(folder, base: str, strategy, steps: int, ckpt_path=None):
    """The LoRA finetune of ``fit`` with the transformer in a ZeRO-2 engine (no EMA: one engine, one model)."""
    from posttrain.modules.models.cards import ZeroConfig

    zero_card = card(base)
    zero_card.specs["transformer"].sharded, zero_card.specs["transformer"].zero = True, ZeroConfig(stage=2)
    torch.manual_seed(0)
    module = Finetune(zero_card, caption_dropout=0.0, ema_decay=None, run=RunArgs(**SIZE))
    fit_checkpointed(module, folder, steps, ckpt_path, strategy=strategy)
    return module


def test_a_zero2_lora_checkpoint_holds_the_adapter_and_loads_as_plain_tensors(tmp_path, base, one_process):
    """The engine saves without the base (``exclude_frozen_parameters``); the gathered weights are plain tensors (no
    autograd history: ``copy.deepcopy`` takes them); the run resumes bitwise and exports from its source."""
    import copy

    from posttrain.lit.engine.strategy import TAG

    folder = tmp_path / "ckpt"
    written = fit_zero(folder, base, one_process(), 2)
    last = folder / "last.ckpt"
    shards = torch.load(last / "transformer" / TAG / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    assert shards["module"] and all("lora_" in k for k in shards["module"]), sorted(shards["module"])[:5]
    assert not shards["frozen_param_fragments"]
    state = ckpt.load(str(last))
    weights = {k: v for k, v in state["state_dict"].items() if k.startswith("card.models.transformer.")}
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    loaded = [v for v in state["state_dict"].values() if isinstance(v, torch.Tensor)]
    assert all(not v.requires_grad and v.grad_fn is None for v in loaded)
    copy.deepcopy(state)
    assert state["posttrain"]["frozen"]["transformer"]["sha256"] == written.card.weights_digest(
        "transformer", frozen_only=True)

    # `validate` reads the gathered adapter onto the base its source builds
    checked = Finetune(card(base), caption_dropout=0.0, ema_decay=None, run=RunArgs(**SIZE))
    checked.card.specs["transformer"].sharded = True
    written_by = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=2, save_last=True, save_top_k=-1)
    quick_trainer(0, strategy=one_process(), limit_val_batches=1, enable_checkpointing=True,
                  callbacks=[written_by]).validate(
        checked, SyntheticVideos(num_samples=8, val_samples=2, batch_size=2, **SIZE), ckpt_path=str(last))
    for key, value in written.card.models["transformer"].state_dict().items():
        assert torch.equal(value, checked.card.models["transformer"].state_dict()[key]), key

    merged = presets.build_model("wan_t2v", pretrained=export(str(last), str(tmp_path / "merged"), pipeline=False,
                                                              lora="merged"))
    served = written.card.models["transformer"]  # at iteration 2, as `last` is now
    served.fuse_lora(lora_scale=1.0)
    served.unload_lora()
    assert all(torch.equal(value, merged.state_dict()[key]) for key, value in served.state_dict().items())

    resumed = fit_zero(folder, base, one_process(), 4, ckpt_path="last")
    straight = fit_zero(tmp_path / "straight", base, one_process(), 4)
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, straight.state_dict()[key]), key
    ends = [ckpt.full_weights(str(f / "last.ckpt" / "transformer")) for f in (folder, tmp_path / "straight")]
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


def test_a_zero2_lora_checkpoint_with_its_base_still_resumes_bitwise(tmp_path, base, one_process, bases_kept):
    """A ZeRO-2 checkpoint written before the base was left out (the engine saved every weight) resumes: the base in
    its shards loads as it is."""
    from posttrain.lit.engine.strategy import TAG

    folder = tmp_path / "ckpt"
    with bases_kept():
        fit_zero(folder, base, one_process(), 2)
    shards = torch.load(folder / "last.ckpt" / "transformer" / TAG / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)
    assert [k for k in shards["module"] if "lora_" not in k]
    resumed = fit_zero(folder, base, one_process(), 4, ckpt_path="last")
    straight = fit_zero(tmp_path / "straight", base, one_process(), 4)
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, straight.state_dict()[key]), key
