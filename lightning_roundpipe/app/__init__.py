"""The Hydra application: ``python examples/train.py`` trains a byte-level model with RoundPipe.

This subpackage is the project's entry point, so unlike the library modules it may import Lightning,
Hydra and OmegaConf. Nothing here is imported by ``lightning_roundpipe`` itself.
"""
