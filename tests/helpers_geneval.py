"""A spawned process of the 2-process metric test: imports only torch and the metric (fast to start)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from posttrain.modules.world.geneval import SyntheticGenEval


def gather_worker(rank: int, world: int, port: int, data_path: str, out: str) -> None:
    """Update on every ``world``-th video from ``rank``, compute (torchmetrics gathers), rank 0 saves."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = torch.load(data_path, weights_only=True)
    mine = list(range(rank, len(data["prompts"]), world))
    metric = SyntheticGenEval()
    metric.update(data["videos"][mine], [data["prompts"][i] for i in mine])
    result = {k: float(v) for k, v in metric.compute().items()}
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()
