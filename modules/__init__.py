"""The parts the methods are made of, with no Lightning, in rooms by what they hold:

- ``models/``: cards of named experts, presets (tiny and published sizes), the generator families
  (``models/generators/``, one file each), refiner LMs, weight versions and sync plans, the embedding cache, VAEs,
  the causal Wan and sequence parallelism;
- ``flow/``: the one flow-matching sampler, conditioning, the flow-matching losses;
- ``rl/``: GRPO settings, advantages, rollouts, workflows of stages, the RL losses;
- ``distill/``: DMD2's losses and GAN heads;
- ``rewards/``: the reward interface and every reward (synthetic, image, preference, intent, remote);
- ``world/``: the synthetic world of moving shapes, its user requests and its GenEval (the laboratory);
- ``eval/``: evaluation runs and Fréchet distance;
- ``io/``: the on-disk checkpoint protocol and its one verified loader, media files, precomputed rows, the batch
  schema.

Imports run one way: ``io`` and ``flow`` lean on nothing here; ``models`` on ``flow``; ``rl``, ``distill`` and
``world`` on ``models`` and ``flow``; ``rewards`` on ``world``; ``eval`` on all of those.
"""
