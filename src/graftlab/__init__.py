"""graftlab: continual learning of post-trained language models by grafting donor updates."""

__version__ = "0.1.0"
