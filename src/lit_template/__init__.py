"""A PyTorch Lightning + Hydra training template that stays correct under DDP."""

__version__ = "0.1.0"
