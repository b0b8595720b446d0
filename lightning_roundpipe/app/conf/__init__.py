# Makes the configs an importable package: Hydra's pkg:// search path (lightning_roundpipe.app.conf) needs one.
