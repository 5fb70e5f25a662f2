"""Callbacks: iterations, weight versions and sync plans, precomputed rows, samples, parity (C2), evaluation,
progress, writer."""
from posttrain.callbacks.evaluation import Evaluate
from posttrain.callbacks.parity import C2Check
from posttrain.callbacks.samples import SampleVideos
from posttrain.callbacks.writer import MediaWriter

__all__ = ["C2Check", "Evaluate", "SampleVideos", "MediaWriter"]
