"""LightningModules (one file per method), their shared base, the sharding strategy, the CLI.

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
