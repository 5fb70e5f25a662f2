"""``posttrain reward``: a config's reward on a folder of videos or on its own data, as a table and a sheet."""
import json

import pytest
from PIL import Image

from posttrain.lit.tools.cli import main
from posttrain.modules.io.media import write_media
from posttrain.modules.world.world import render

CONFIG = "configs/flow_grpo.yaml"  # SyntheticGenEvalReward: shape, colour, background, motion


def test_reward_check_ranks_a_folder_of_videos_in_its_table_and_sheet(tmp_path, capsys):
    """Three GIFs with the caption of what they show and three whose caption names other colours: the table has
    the total and the four facts, the matching videos rank first, the sheet shows the top and bottom three."""
    folder = tmp_path / "clips"
    shows = [("circle", "red", "left", "blue"), ("square", "green", "up", "magenta"), ("circle", "cyan", "right", "red")]
    for i, (shape, colour, motion, background) in enumerate(shows):
        video = render(shape, colour, motion, background, 9, 32, 32)
        for tag, (c, b) in (("match", (colour, background)), ("other", ("yellow", "green"))):
            write_media(str(folder / f"{i}_{tag}.gif"), video)
            (folder / f"{i}_{tag}.txt").write_text(f"a {c} {shape} moving {motion} on a {b} background")
    out = tmp_path / "check"
    main(["reward", "--config", CONFIG, "--videos", str(folder), "--out", str(out), "--top", "3"])
    printed = capsys.readouterr().out
    lines = (out / "reward_table.txt").read_text().splitlines()
    assert lines[0] == f"SyntheticGenEvalReward on 6 samples (folder {folder})"
    assert [line.split()[0] for line in lines[1:]] == ["term", "total", "background", "colour", "motion", "shape"]
    assert all(len(line.split()) == 5 for line in lines[2:])  # mean std min max
    assert lines[0] in printed and "reward_sheet.png" in printed
    scores = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    assert len(scores) == 6 and set(scores[0]["terms"]) == {"shape", "colour", "background", "motion"}
    ranked = sorted(scores, key=lambda s: -s["total"])
    assert all("yellow" not in s["prompt"] for s in ranked[:3]) and all("yellow" in s["prompt"] for s in ranked[3:])
    with Image.open(out / "reward_sheet.png") as sheet:
        assert sheet.format == "PNG" and sheet.size == (960, 420)  # 3 columns x 3.2 in, 4.2 in, at 100 dpi


def test_reward_check_scores_the_configs_generator_on_its_prompts(tmp_path):
    """Prompt data: the config's generator samples the videos (4 prompts); every value is in [0, 1]."""
    out = tmp_path / "check"
    main(["reward", "--config", CONFIG, "--out", str(out), "--num_samples", "4", "--top", "2"])
    lines = (out / "reward_table.txt").read_text().splitlines()
    assert lines[0] == "SyntheticGenEvalReward on 4 samples (the config's generator on the prompts of Prompts)"
    for line in lines[2:]:
        mean, std, low, high = map(float, line.split()[1:])
        assert 0.0 <= low <= mean <= high <= 1.0 and std >= 0.0
    assert len((out / "scores.jsonl").read_text().splitlines()) == 4
    assert (out / "reward_sheet.png").stat().st_size > 0


def test_reward_check_refuses_bad_numbers(capsys):
    with pytest.raises(SystemExit):
        main(["reward", "--config", CONFIG, "--num_samples", "0"])
    assert "reward: num_samples=0 must be >= 1" in capsys.readouterr().err
