"""LightningDataModules: synthetic shape videos (the default), folders of your videos and images (several datasets,
aspect-ratio and frame-count buckets, frame windows), prompt lists, user requests of the synthetic world with their
facts, rows precomputed by ``posttrain preprocess``. Every item follows one batch schema (``prompt``, ``index``, the
group key ``group``, and the media), documented in ``posttrain.modules.io.batch``."""
from posttrain.datamodules.folder import FolderSet, VideoFolder
from posttrain.datamodules.precomputed import PrecomputedVideos
from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.requests import Requests
from posttrain.datamodules.synthetic import SyntheticVideos

__all__ = ["SyntheticVideos", "VideoFolder", "FolderSet", "Prompts", "Requests", "PrecomputedVideos"]
