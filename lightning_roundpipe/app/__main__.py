"""``python -m lightning_roundpipe.app [group=option] [key=value ...]``: the same job as ``roundpipe-train``."""

from lightning_roundpipe.app.train import main

if __name__ == "__main__":
    main()
