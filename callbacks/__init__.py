"""Callbacks: iterations, weight versions and sync plans, precomputed rows, samples, log-probability parity,
evaluation, progress, writer."""
from posttrain.callbacks.evaluation import Evaluate
from posttrain.callbacks.parity import C2Check, LogProbParityCheck
from posttrain.callbacks.samples import SampleVideos
from posttrain.callbacks.writer import MediaWriter

__all__ = ["LogProbParityCheck", "C2Check", "Evaluate", "SampleVideos", "MediaWriter"]
