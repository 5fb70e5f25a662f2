"""Preference rewards from local folders (modules/rewards/preference.py) on tiny random models of their real classes:
shapes, determinism, the frame aggregation, the reference formula of each score, and refused folders."""
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from helpers import tiny_clip_folder
from posttrain.modules.rewards.preference import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, AestheticHead, HPSv21, LaionAesthetic,
                                          PickScore, frame_indices, hps_state_dict)
from posttrain.modules.rewards.base import score

PROMPTS = ["a red circle moving left on a blue background", "a green square"]
# the reward and the written-out reference run the same float32 ops in another order (batched matmul vs sum)
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny random CLIPModel + CLIPProcessor folder, with a random aesthetic head beside it."""
    path = tiny_clip_folder(str(tmp_path_factory.mktemp("clip")))
    torch.manual_seed(1)
    save_file(AestheticHead(16).state_dict(), os.path.join(path, "aesthetic_head.safetensors"))
    return path


def media(batch=2, frames=5, height=24, width=40, seed=0):
    """(B, 3, F, H, W) in [-1, 1]; not square, so resizing and HPSv2's padding matter."""
    return torch.rand(batch, 3, frames, height, width, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def pictures(images):
    """(N, 3, H, W) in [-1, 1] as PIL images, as the references open them from saved files."""
    arr = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arr]


REWARDS = {"PickScore": PickScore, "HPSv21": HPSv21, "LaionAesthetic": LaionAesthetic}


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_scores_videos_and_images_per_sample_deterministically_as_the_mean_over_frames(clip_folder, name):
    """A (B, 3, F, H, W) batch gets B finite scores, the same twice; a video's score is the mean of its frames'
    scores as images (frames round(linspace(0, F-1, 4)) = 0, 1, 3, 4 of 5); an image batch scores too."""
    reward = REWARDS[name](clip_folder, frames=4)
    videos = media()
    out = score(reward, videos, PROMPTS)
    assert out.total.shape == (2,) and torch.isfinite(out.total).all()
    assert torch.equal(out.total, score(reward, videos, PROMPTS).total)
    assert torch.equal(out.terms[reward.term], out.total)
    assert frame_indices(5, 4).tolist() == [0, 1, 3, 4]
    frame_scores = torch.stack([score(reward, videos[:, :, i:i + 1], PROMPTS).total for i in (0, 1, 3, 4)], 1)
    torch.testing.assert_close(out.total, frame_scores.mean(1), rtol=RTOL, atol=ATOL)
    assert not torch.allclose(frame_scores[:, 0], frame_scores[:, 1])  # the frames differ, so the mean is no copy
    images = score(reward, media(batch=3, frames=1, seed=1), PROMPTS + ["a cat"])
    assert images.total.shape == (3,) and torch.isfinite(images.total).all()


def test_pickscore_is_the_reference_logit_scale_times_cosine(clip_folder):
    """PickScore's README: processor(images / text, padding, truncation, max_length=77), features L2-normalized,
    ``logit_scale.exp() * text_embs @ image_embs.T``, the diagonal (each image with its prompt)."""
    from transformers import AutoProcessor, CLIPModel

    images = media(frames=1)[:, :, 0]
    model = CLIPModel.from_pretrained(clip_folder).eval()
    processor = AutoProcessor.from_pretrained(clip_folder)
    with torch.no_grad():
        image_inputs = processor(images=pictures(images), padding=True, truncation=True, max_length=77,
                                 return_tensors="pt")
        text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = model.get_image_features(pixel_values=image_inputs["pixel_values"]).pooler_output
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = model.get_text_features(**text_inputs).pooler_output
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        expected = torch.diagonal(model.logit_scale.exp() * (text_embs @ image_embs.T))
    out = score(PickScore(clip_folder), images[:, :, None], PROMPTS)
    torch.testing.assert_close(out.total, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.terms["cosine"], expected / model.logit_scale.exp(), rtol=RTOL, atol=ATOL)


def test_hps_is_the_reference_cosine_on_hpsv2s_preprocessing(clip_folder):
    """hpsv2/img_score.py: preprocess_val = ResizeMaxSize(S) (longest side to S, bicubic, zero-pad centred) +
    ToTensor + Normalize(OpenAI mean/std); features normalized; ``image_features @ text_features.T``, diagonal."""
    from transformers import CLIPModel, CLIPTokenizer

    images = media(frames=1)[:, :, 0]  # 24 x 40 -> 19 x 32, padded 6 above and 7 below in a 32 x 32 picture
    model = CLIPModel.from_pretrained(clip_folder).eval()
    tokenizer = CLIPTokenizer.from_pretrained(clip_folder)
    S = model.config.vision_config.image_size

    def preprocess_val(img):
        w, h = img.size
        scale = S / float(max(h, w))
        new_h, new_w = round(h * scale), round(w * scale)
        img = np.asarray(img.resize((new_w, new_h), Image.BICUBIC))
        pad_h, pad_w = S - new_h, S - new_w
        img = np.pad(img, ((pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
        x = torch.from_numpy(img).permute(2, 0, 1).float() / 255
        return (x - torch.tensor(OPENAI_CLIP_MEAN)[:, None, None]) / torch.tensor(OPENAI_CLIP_STD)[:, None, None]

    with torch.no_grad():
        image = torch.stack([preprocess_val(p) for p in pictures(images)])
        text = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        image_features = model.get_image_features(pixel_values=image).pooler_output
        text_features = model.get_text_features(**text).pooler_output
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        expected = torch.diagonal(image_features @ text_features.T)
    out = score(HPSv21(clip_folder), images[:, :, None], PROMPTS)
    torch.testing.assert_close(out.total, expected, rtol=RTOL, atol=ATOL)


def test_aesthetic_is_the_reference_mlp_on_the_normalized_embedding(clip_folder):
    """simple_inference.py: ``normalized(encode_image(x))`` (numpy L2) then the MLP 768-1024-128-64-16-1 with no
    activation (dropout is off in eval): written out here as the five affine maps."""
    from safetensors.torch import load_file
    from transformers import CLIPImageProcessor, CLIPModel

    images = media(frames=1)[:, :, 0]
    model = CLIPModel.from_pretrained(clip_folder).eval()
    processor = CLIPImageProcessor.from_pretrained(clip_folder)
    w = load_file(os.path.join(clip_folder, "aesthetic_head.safetensors"))
    with torch.no_grad():
        emb = model.get_image_features(**processor(images=pictures(images), return_tensors="pt")).pooler_output
    a = emb.numpy().astype(np.float64)
    x = torch.from_numpy(a / np.linalg.norm(a, 2, -1, keepdims=True)).float()
    for i in (0, 2, 4, 6, 7):
        x = x @ w[f"layers.{i}.weight"].T + w[f"layers.{i}.bias"]
    out = score(LaionAesthetic(clip_folder), images[:, :, None], PROMPTS)
    torch.testing.assert_close(out.total, x.squeeze(-1), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_a_folder_that_cannot_serve_stops_at_construction_with_the_fix(clip_folder, tmp_path, name):
    """Another model class (a CLIPVisionModel, no text tower), no folder, no weights: refused when the reward is
    built, naming the folder and what to give."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    vision = tmp_path / "vision"
    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=8)).save_pretrained(vision)
    with pytest.raises(ValueError, match=rf"{name}: '{vision}' holds a CLIPVisionConfig \(model_type "
                                         rf"'clip_vision_model'\), not a CLIP"):
        REWARDS[name](str(vision))
    with pytest.raises(FileNotFoundError, match=rf"{name}: path='{tmp_path / 'missing'}' is not a local folder; "
                                                rf"give `path:` a local folder"):
        REWARDS[name](str(tmp_path / "missing"))
    unweighted = tmp_path / "unweighted"
    shutil.copytree(clip_folder, unweighted)
    os.remove(unweighted / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}: '{unweighted}' has no loadable safetensors weights"):
        REWARDS[name](str(unweighted))


def test_missing_tokenizer_and_wrong_head_are_refused(clip_folder, tmp_path):
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(clip_folder, no_tokenizer)
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(no_tokenizer / name):
            os.remove(no_tokenizer / name)
    with pytest.raises(ValueError, match=rf"PickScore: processor='{no_tokenizer}' holds no tokenizer"):
        PickScore(str(no_tokenizer))
    os.remove(no_tokenizer / "aesthetic_head.safetensors")
    with pytest.raises(FileNotFoundError, match="LaionAesthetic: no head weights at"):
        LaionAesthetic(str(no_tokenizer))
    wrong = tmp_path / "wrong_head.safetensors"
    save_file(AestheticHead(768).state_dict(), str(wrong))
    with pytest.raises(ValueError, match="is not the aesthetic MLP for 16-d embeddings"):
        LaionAesthetic(clip_folder, head=str(wrong))


def test_hps_state_dict_maps_an_open_clip_checkpoint_onto_every_clip_weight(clip_folder):
    """An open_clip (OpenAI layout) state dict written from a CLIPModel — q/k/v fused into ``in_proj``,
    projections as (width, dim) matrices — maps back onto every weight of the CLIPModel, exactly."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(clip_folder)
    sd = model.state_dict()
    oc = {"visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
          "visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
          "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
          "visual.proj": sd["visual_projection.weight"].T, "text_projection": sd["text_projection.weight"].T,
          "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
          "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
          "logit_scale": sd["logit_scale"]}
    for a, b in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                 ("ln_final", "text_model.final_layer_norm")):
        for p in ("weight", "bias"):
            oc[f"{a}.{p}"] = sd[f"{b}.{p}"]
    for src, dst in (("visual.transformer.resblocks.0", "vision_model.encoder.layers.0"),
                     ("transformer.resblocks.0", "text_model.encoder.layers.0")):
        for p in ("weight", "bias"):
            oc[f"{src}.attn.in_proj_{p}"] = torch.cat([sd[f"{dst}.self_attn.{n}_proj.{p}"] for n in "qkv"])
            for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                oc[f"{src}.{a}.{p}"] = sd[f"{dst}.{b}.{p}"]
    mapped = hps_state_dict(oc, num_vision_layers=1, num_text_layers=1)
    assert set(mapped) == set(sd)
    assert all(torch.equal(mapped[k], sd[k]) for k in sd)


def test_estimate_counts_a_local_reward_models_frozen_weights(clip_folder, tmp_path):
    """A WeightedReward of PickScore and the aesthetic predictor in flow_grpo's config: one row per model, its
    parameters in float32, no gradients or optimizer state, in the device total."""
    import yaml
    from transformers import CLIPModel

    from posttrain.lit.tools.estimate import estimate

    with open("configs/flow_grpo.yaml") as f:
        config = yaml.safe_load(f)
    config["model"]["init_args"]["reward"] = {"class_path": "WeightedReward", "init_args": {"rewards": {
        "pick": {"class_path": "PickScore", "init_args": {"path": clip_folder}},
        "aes": {"class_path": "LaionAesthetic", "init_args": {"path": clip_folder}}}}}
    path = tmp_path / "flow_grpo_pickscore.yaml"
    path.write_text(yaml.safe_dump(config))
    result = estimate(str(path), activations=False)
    clip = sum(p.numel() for p in CLIPModel.from_pretrained(clip_folder).parameters())
    head = sum(p.numel() for p in AestheticHead(16).parameters())
    for name, params in (("reward/pick/pickscore", clip), ("reward/aes/aesthetic_clip", clip),
                         ("reward/aes/aesthetic_head", head)):
        row = result[name]
        assert (row.params, row.trainable, row.param_bytes, row.grad_bytes, row.optimizer_bytes) == \
            (params, 0, 4 * params, 0, 0), name
        assert row.placement == "frozen reward" and name in result.table()
    assert result.device_bytes == sum(c.device_bytes for c in result.components)
