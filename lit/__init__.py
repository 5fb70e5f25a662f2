"""The methods: one LightningModule per file, in front, on their shared base (``base.py``); behind them
``engine/`` (the sharding strategy, checkpoint I/O, exact resume, log cadence, start-up checks) and ``tools/``
(the ``posttrain`` commands). ``strategy.py`` and ``tracking.py`` here keep the older config paths working.

The methods are imported here so that YAML can name them by class (``model: {class_path: Finetune}``).
"""
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.lit.diffusion_nft import DiffusionNFT
from posttrain.lit.dmd2 import DMD2
from posttrain.lit.finetune import Finetune
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.joint_rl import JointRL
from posttrain.lit.workflow import Workflow
from posttrain.lit.workflow_rl import WorkflowRL

__all__ = ["ExpertModule", "RunArgs", "Finetune", "FlowGRPO", "DiffusionNFT", "JointRL", "DMD2", "Workflow",
           "WorkflowRL"]
