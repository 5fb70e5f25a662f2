"""The embedded default data: seeded videos of a coloured shape moving over a coloured background.

Every sample is a pure function of ``(seed, index)``: a shape (circle, square or triangle) of one
colour moves in one direction over a background of another, and the caption names all four facts,
e.g. ``"a red circle moving left on a blue background"`` (the world itself, its renderer and its
vocabulary live in ``modules/world/world.py``; ``modules/world/geneval.py`` reads the facts back from pixels).

Concepts can be held out: ``exclude`` drops every sample that shows one of the listed values, and
``include`` keeps only samples that show at least one. A value is a word (``"magenta"``: as shape
colour or background) or ``fact:word`` (``"colour:magenta"``: only as the shape's colour). The
pretrained generator never saw ``PRETRAIN_EXCLUDE``; ``configs/finetune.yaml`` teaches it from data.

Concept mixing (DreamBooth's prior preservation as data, Ruiz et al. 2023): ``concept`` with
``concept_fraction`` f makes ⌊n·f⌋ or ⌈n·f⌉ of any ``n`` consecutive indices show the concept and
the others the rest of the world (never the concept), so an epoch holds the fraction and a shuffled
batch of B holds f·B on average. Without them the world's own mix stands (magenta in about
1/3 of unfiltered samples).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.world.world import FACTS, MOTIONS, PALETTE, SHAPES, SPEED, Facts, caption, parse_caption, render

COLOURS = PALETTE  # the name this module has always exported
# What the shipped generator (modules/assets/wan_t2v) was pretrained without: no magenta anywhere.
PRETRAIN_EXCLUDE = ("magenta",)
_VALUES = {"shape": SHAPES, "colour": tuple(PALETTE), "background": tuple(PALETTE), "motion": tuple(MOTIONS)}


def parse_concepts(values: Sequence[str], option: str) -> list[tuple[Optional[str], str]]:
    """``["magenta", "shape:triangle"]`` -> ``[(None, "magenta"), ("shape", "triangle")]``; an unknown fact
    or word raises, naming ``option`` and the vocabulary."""
    concepts, problems = [], []
    for value in values:
        fact, _, word = value.rpartition(":")
        if fact and fact not in _VALUES:
            problems.append(f"{value!r}: unknown fact {fact!r}; use one of {list(_VALUES)}")
        elif word not in (_VALUES[fact] if fact else sum(_VALUES.values(), ())):
            allowed = _VALUES[fact] if fact else sorted(set(sum(_VALUES.values(), ())))
            problems.append(f"{value!r}: {word!r} is not a value of {fact or 'the world'}; use one of {list(allowed)}")
        else:
            concepts.append((fact or None, word))
    if problems:
        raise ValueError(f"{option}: " + "; ".join(problems) + " (a word, or fact:word as in 'colour:magenta')")
    return concepts


def shows(facts: Facts, concept: tuple[Optional[str], str]) -> bool:
    fact, word = concept
    return any(getattr(facts, f) == word for f in ([fact] if fact else FACTS))


def shape_start(seed: int, index: int) -> tuple[float, float]:
    """Where the shape of sample ``index`` of a ``seed``'s clips starts, (x, y) as fractions of the frame."""
    g = torch.Generator().manual_seed(seed * 7_919 + index)
    return tuple(float(v) for v in 0.25 + 0.5 * torch.rand(2, generator=g))


class ShapesDataset(Dataset):
    """``num_samples`` seeded (video, prompt) pairs; ``index`` picks the facts, ``seed`` the layout.

    ``exclude`` / ``include``: concepts (see the module docstring) a sample must not / must show. The
    facts of an index are redrawn from its own generator until they pass, so every sample stays a pure
    function of ``(seed, index)`` and the unfiltered data is unchanged. ``concept`` and
    ``concept_fraction``: the mixing of the module docstring, on top of ``exclude`` / ``include``.
    ``exclude_captions``: whole captions no sample may have (e.g. an evaluation's, to score it on
    combinations training never showed).
    ``speed``: how far the shape moves per frame step, a fraction of the frame (``modules.world.PACE``: the
    shipped 5-frame world's pace, so a longer clip continues its motion); None: ``SPEED`` over the whole
    clip, whatever its length.
    """

    def __init__(self, num_samples: int, frames: int, height: int, width: int, seed: int = 0,
                 exclude: Sequence[str] = (), include: Sequence[str] = (), concept: Sequence[str] = (),
                 concept_fraction: Optional[float] = None, exclude_captions: Sequence[str] = (),
                 speed: Optional[float] = None):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1 (synthetic videos per epoch, e.g. 64)")
        self.num_samples, self.frames, self.height, self.width, self.seed = num_samples, frames, height, width, seed
        self.exclude = parse_concepts(exclude, "exclude")
        self.include = parse_concepts(include, "include")
        self.concept = parse_concepts(concept, "concept")
        clash = [c for c in self.include if c in self.exclude]
        if clash:
            raise ValueError(f"include and exclude both name {clash}; no sample can pass")
        if bool(self.concept) != (concept_fraction is not None):
            raise ValueError(f"concept={list(concept)} and concept_fraction={concept_fraction} come together: name "
                             f"the concept (e.g. [magenta]) and the share of samples showing it (e.g. 0.5)")
        if concept_fraction is not None and not 0.0 <= concept_fraction <= 1.0:
            raise ValueError(f"concept_fraction={concept_fraction} must be in [0, 1] (e.g. 0.5: half of the samples "
                             f"show the concept, half the rest of the world)")
        self.concept_fraction = concept_fraction
        written = {c: parse_caption(c) for c in exclude_captions}
        not_captions = [c for c, f in written.items() if c != caption(f.shape, f.colour, f.motion, f.background)]
        if not_captions:
            raise ValueError(f"exclude_captions: {not_captions} are not captions of the world; write them as "
                             f"{caption('circle', 'red', 'left', 'blue')!r}")
        self.exclude_captions = frozenset(exclude_captions)
        if speed is not None and not 0.0 < speed < 0.5:
            raise ValueError(f"speed={speed} must be in (0, 0.5): the fraction of the frame the shape moves per frame "
                             f"step (e.g. modules.world.PACE = {SPEED / 4}); leave it unset for SPEED over the clip")
        self.speed = speed

    def shows_concept(self, index: int) -> Optional[bool]:
        """Whether sample ``index`` must show the concept (None: no mixing). Index i does when
        ⌊(i+1)·f⌋ > ⌊i·f⌋: ⌊n·f⌋ or ⌈n·f⌉ of any n consecutive indices, spread evenly."""
        if self.concept_fraction is None:
            return None
        f = self.concept_fraction
        return int((index + 1) * f) > int(index * f)

    def __len__(self) -> int:
        return self.num_samples

    def accepts(self, facts: Facts, concept: Optional[bool] = None) -> bool:
        if concept is not None and any(shows(facts, c) for c in self.concept) != concept:
            return False
        if caption(facts.shape, facts.colour, facts.motion, facts.background) in self.exclude_captions:
            return False
        return not any(shows(facts, c) for c in self.exclude) and \
            (not self.include or any(shows(facts, c) for c in self.include))

    def facts(self, index: int) -> tuple[str, str, str, str]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        colours, concept = list(COLOURS), self.shows_concept(index)
        for _ in range(1000):
            colour = colours[int(torch.randint(len(colours), (1,), generator=g))]
            background = [c for c in colours if c != colour][int(torch.randint(len(colours) - 1, (1,), generator=g))]
            shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
            motion = list(MOTIONS)[int(torch.randint(len(MOTIONS), (1,), generator=g))]
            if self.accepts(Facts(shape, colour, background, motion), concept):
                return shape, colour, motion, background
        mixing = "" if concept is None else \
            f" concept={self.concept} (sample {index} {'must' if concept else 'must not'} show it)"
        raise ValueError(f"no sample passes exclude={self.exclude} include={self.include}{mixing} and "
                         f"{len(self.exclude_captions)} excluded captions; loosen them")

    def captions(self) -> list[str]:
        """Every sample's caption, in index order, without rendering its clip."""
        return [caption(*self.facts(i)) for i in range(self.num_samples)]

    def __getitem__(self, index: int) -> dict:
        shape, colour, motion, background = self.facts(index)
        start = shape_start(self.seed, index)
        speed = SPEED if self.speed is None else self.speed * max(self.frames - 1, 1)
        video = render(shape, colour, motion, background, self.frames, self.height, self.width, start=start, speed=speed)
        return batch_schema.item(caption(shape, colour, motion, background), index, video=video)


class SyntheticVideos(ResumableDataModule):
    """Captioned shape videos, generated on the fly (the embedded default for finetune and predict).

    Args:
        num_samples: training set size; validation uses ``val_samples`` more indices after them.
        frames, height, width: video size in pixels (Wan VAE: frames = 4k+1; H and W multiples of the
            VAE's spatial compression); the ``posttrain`` command sets them from ``model.init_args.run``.
        batch_size, num_workers, seed: loader settings; ``seed`` fixes content and order.
        exclude, include: concepts held out of / required in every split (``"magenta"``,
            ``"colour:magenta"``; see the module docstring).
        concept, concept_fraction: the share of samples (of every split) that show ``concept``; the others
            show the rest of the world (prior preservation; see the module docstring). Both unset: the
            world's own mix.
        exclude_captions: whole captions held out of every split (``"a red circle moving left on a blue
            background"``), e.g. an evaluation's.
    """

    def __init__(self, num_samples: int = 512, val_samples: int = 8, frames: int = 5, height: int = 32,
                 width: int = 32, batch_size: int = 4, num_workers: int = 0, seed: int = 0,
                 exclude: Sequence[str] = (), include: Sequence[str] = (), concept: Sequence[str] = (),
                 concept_fraction: Optional[float] = None, exclude_captions: Sequence[str] = ()):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.num_samples, self.val_samples = num_samples, val_samples
        self.frames, self.height, self.width = frames, height, width
        self.exclude, self.include = list(exclude), list(include)
        self.concept, self.concept_fraction = list(concept), concept_fraction
        self.exclude_captions = list(exclude_captions)
        self.dataset(1)  # check the concepts and captions at start-up

    def dataset(self, num_samples: int, seed_offset: int = 0) -> ShapesDataset:
        return ShapesDataset(num_samples, self.frames, self.height, self.width, self.seed + seed_offset,
                             exclude=self.exclude, include=self.include, concept=self.concept,
                             concept_fraction=self.concept_fraction, exclude_captions=self.exclude_captions)

    def train_dataset(self) -> Dataset:
        return self.dataset(self.num_samples)

    def prompt_list(self) -> list[str]:
        """The training clips' captions, in index order (``Prompts``' synthetic captions of the same seed and
        filters: a prompt-only method on ``Prompts`` and one on these clips train on the same captions)."""
        return self.dataset(self.num_samples).captions()

    def sample_prompts(self, k: int) -> list[str]:
        """The first ``k`` validation captions (those of ``val_dataloader``), without rendering a clip."""
        dataset = self.dataset(self.num_samples + self.val_samples)
        first = self.num_samples
        return [caption(*dataset.facts(i)) for i in range(first, first + min(k, self.val_samples))]

    def val_dataloader(self) -> Optional[DataLoader]:
        dataset = self.dataset(self.num_samples + self.val_samples)
        subset = torch.utils.data.Subset(dataset, range(self.num_samples, self.num_samples + self.val_samples))
        return DataLoader(subset, batch_size=self.batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        dataset = self.dataset(self.val_samples, seed_offset=1)
        # the first frame rides along: an image-to-video generator animates it (the others ignore it)
        prompts = [batch_schema.item(dataset[i]["prompt"], i, image=dataset[i]["video"][:, 0])
                   for i in range(len(dataset))]
        return DataLoader(prompts, batch_size=self.batch_size)
