"""`posttrain predict` writes media; `posttrain export` writes a folder diffusers loads on its own."""
from __future__ import annotations

import os
import subprocess
import sys

import imageio.v2 as imageio
import torch
from diffusers import WanTransformer3DModel

from posttrain.callbacks.writer import MediaWriter
from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.export import export
from posttrain.lit.finetune import Finetune
from tests.conftest import wan_card
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_predict_writes_one_video_per_prompt(tmp_path):
    module = Finetune(wan_card(), sampler=None, frames=5, height=16, width=16)
    writer = MediaWriter(output_dir=str(tmp_path), format="mp4")
    trainer = quick_trainer(max_steps=1, callbacks=[writer])
    prompts = ["a red circle moving left on a blue background", "a green square moving up on a cyan background",
               "a yellow triangle moving down on a magenta background"]
    trainer.predict(module, Prompts(prompts=prompts, batch_size=2))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and all(f.endswith(".mp4") for f in files)
    frames = imageio.mimread(os.path.join(tmp_path, files[0]))
    assert len(frames) == 5 and frames[0].shape[2] == 3


def test_generate_is_seeded():
    module = Finetune(wan_card(), frames=5, height=16, width=16)
    module.configure_model()
    a = module.generate(["a red circle"], seed=1)
    b = module.generate(["a red circle"], seed=1)
    c = module.generate(["a red circle"], seed=2)
    assert a.shape == (1, 3, 5, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)


def test_export_loads_without_posttrain(tmp_path):
    module = Finetune(wan_card(lr=1e-2), caption_dropout=0.0, ema_decay=0.9)
    trainer = quick_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2))
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    # the CLI entry point, then a fresh interpreter that never imports posttrain's packages
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "posttrain", "export", "--ckpt", str(ckpt), "--out", str(out),
                           "--expert", "transformer_ema"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    code = ("import sys, torch; from diffusers import WanTransformer3DModel; "
            f"m = WanTransformer3DModel.from_pretrained({str(out)!r}); "
            "assert not any(k.startswith('posttrain') for k in sys.modules); "
            f"torch.save(m.state_dict(), {str(tmp_path / 'sd.pt')!r})")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    state = torch.load(tmp_path / "sd.pt")
    trained = module.card["transformer_ema"].state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)
    # and in-process for the plain generator, with an unknown expert refused
    export(str(ckpt), str(tmp_path / "gen"))
    assert WanTransformer3DModel.from_pretrained(tmp_path / "gen").config.num_layers == 2
    try:
        export(str(ckpt), str(tmp_path / "x"), expert="critic")
    except ValueError as err:
        assert "no component 'critic'" in str(err)
    else:
        raise AssertionError("export of a missing expert did not fail")
