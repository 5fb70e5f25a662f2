"""Prompt lists for rollout methods and ``predict``: a ``.txt`` (one per line), a ``.jsonl``
(``{"prompt": ...}`` per line), an inline list, or the synthetic captions of the default data."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule
from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.io import batch as batch_schema


PROMPT_LINE = ('each line is one JSON object, keys and strings in double quotes: {"prompt": "a red circle moving left '
               'on a blue background"} (or write a .txt file, one prompt per line)')
GIVE_PROMPTS = ("give at least one, e.g. `--data.init_args.prompts='[\"a red circle moving left\"]'` (YAML: `prompts: "
                "[...]` under data.init_args), or a file with `path: prompts.txt` (one prompt per line), or drop "
                "`prompts` for the synthetic captions")


def read_prompts(path: str) -> list[str]:
    """Prompts of a .txt or .jsonl file; a clear error names the file and line of any problem."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist; give `path` a text file with one prompt per "
                                f"line, or leave it null for the synthetic captions")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise ValueError(f"prompt file {path!r}: use .txt (one prompt per line) or .jsonl ({{\"prompt\": ...}})")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if ext == ".txt":
                prompts.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}, column {err.colno}): {line[:80]!r}; "
                                 f"{PROMPT_LINE}") from err
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                raise ValueError(f"{path}:{lineno}: expected an object with a non-empty string \"prompt\", "
                                 f"got {line[:80]!r}; {PROMPT_LINE}")
            prompts.append(record["prompt"].strip())
    if not prompts:
        raise ValueError(f"prompt file {path!r} holds no prompts; write one prompt per line")
    return prompts


class PromptDataset(Dataset):
    def __init__(self, prompts: list[str]):
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict:
        return batch_schema.item(self.prompts[index], index)


class Prompts(ResumableDataModule):
    """Args:
        path: a .txt or .jsonl prompt file.
        prompts: an inline list (instead of ``path``).
        num_synthetic: with neither, this many captions of the synthetic shape videos.
        exclude, include: concepts the synthetic captions must not / must name (``"magenta"``,
            ``"colour:magenta"``; as ``SyntheticVideos``).
        batch_size: prompts per iteration (each becomes a group of K samples in RL).
        seed: order of the prompts (and the synthetic captions).
    """

    def __init__(self, path: Optional[str] = None, prompts: Optional[list[str]] = None, num_synthetic: int = 64,
                 batch_size: int = 2, num_workers: int = 0, seed: int = 0, exclude: Sequence[str] = (),
                 include: Sequence[str] = ()):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        if path is not None and prompts is not None:
            raise ValueError("Prompts: give `path` or `prompts`, not both")
        if prompts is not None and not [p for p in prompts if p.strip()]:
            raise ValueError(f"Prompts: the inline `prompts` list is empty; {GIVE_PROMPTS}")
        if (exclude or include) and (path is not None or prompts is not None):
            raise ValueError("Prompts: exclude/include filter the synthetic captions; drop them or `path`/`prompts`")
        self.path, self.inline, self.num_synthetic = path, prompts, num_synthetic
        self.exclude, self.include = list(exclude), list(include)
        if path is None and prompts is None:
            ShapesDataset(1, 1, 8, 8, self.seed, exclude=self.exclude, include=self.include)  # check at start-up

    def prompt_list(self) -> list[str]:
        if self.path is not None:
            return read_prompts(self.path)
        if self.inline is not None:
            return [p.strip() for p in self.inline if p.strip()]
        return ShapesDataset(self.num_synthetic, 1, 8, 8, self.seed, exclude=self.exclude,
                             include=self.include).captions()

    def train_dataset(self) -> Dataset:
        return PromptDataset(self.prompt_list())

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(PromptDataset(self.prompt_list()), batch_size=self.batch_size)

    def val_prompts(self) -> list[str]:
        prompts = self.prompt_list()
        return prompts[: max(self.batch_size, min(8, len(prompts)))]

    def sample_prompts(self, k: int) -> list[str]:
        return self.val_prompts()[:k]

    def val_dataloader(self) -> DataLoader:
        return DataLoader(PromptDataset(self.val_prompts()), batch_size=self.batch_size)
