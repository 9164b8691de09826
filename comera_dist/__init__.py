"""comera-dist: distributed rank-adaptive tensor-train (CoMERA) pretraining on DeepSpeed."""

__version__ = "0.1.0"
